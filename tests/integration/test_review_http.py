"""The services' HTTP endpoint against clients that never finish their request (slowloris).

A client that connects and sends nothing, or stops in the middle of its headers or body,
must not hold its connection (and a task) forever: after the request timeout it gets 408
and the connection is closed. A normal request still works.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from gpupool.runtime.http import HttpEndpoint

pytestmark = pytest.mark.integration

REQUEST_TIMEOUT = 0.5


@pytest.fixture
async def port() -> AsyncIterator[int]:
    endpoint = HttpEndpoint(request_timeout_seconds=REQUEST_TIMEOUT)

    async def takes_a_body(body: bytes) -> tuple[int, str, bytes]:
        return 200, "text/plain", body

    endpoint.add("POST", "/body", takes_a_body)
    bound = await endpoint.start("127.0.0.1", 0)
    try:
        yield bound
    finally:
        await endpoint.stop()


async def answer(port: int, sent: bytes) -> bytes:
    """What the server sends back until it closes, for a client that sends ``sent`` and then waits."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(sent)
        await writer.drain()
        async with asyncio.timeout(REQUEST_TIMEOUT + 5):
            return await reader.read()
    finally:
        writer.close()


@pytest.mark.parametrize(
    "sent",
    [
        pytest.param(b"", id="nothing"),
        pytest.param(b"GET /healthz HTTP/1.1\r\n", id="no-end-of-headers"),
        pytest.param(b"POST /body HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc", id="short-body"),
    ],
)
async def test_a_client_that_never_finishes_its_request_is_answered_408_and_dropped(
    port: int, sent: bytes
) -> None:
    response = await answer(port, sent)
    assert response.startswith(b"HTTP/1.1 408 ")


async def test_a_complete_request_is_still_answered(port: int) -> None:
    response = await answer(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert response.startswith(b"HTTP/1.1 200 OK")
    assert response.endswith(b"ok\n")
