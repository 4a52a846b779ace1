"""The services' HTTP endpoint (every service, the extender and the webhook use it) is bounded.

Against the real asyncio server on loopback: a body where the route takes none, or
larger than the route's cap, is refused with 413 *before* it is sent (the client
gets the answer after sending only the headers: nothing of the body was read); an
oversized header line or header block gets 431; a chunked body 411; connections
beyond the cap get 503 at once while the others are served; a client that trickles
its request (slowloris) is cut off at the request deadline even though it keeps
sending.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from gpupool.runtime.http import MAX_BODY, MAX_HEADER_BYTES, MAX_LINE_BYTES, HttpEndpoint

pytestmark = pytest.mark.integration

REQUEST_TIMEOUT = 1.0
MAX_CONNECTIONS = 4


async def echo(body: bytes) -> tuple[int, str, bytes]:
    return 200, "text/plain", f"{len(body)}\n".encode()


@pytest.fixture
async def endpoint() -> AsyncIterator[tuple[HttpEndpoint, int]]:
    server = HttpEndpoint(request_timeout_seconds=REQUEST_TIMEOUT, max_connections=MAX_CONNECTIONS)
    server.add("POST", "/echo", echo, max_body=1024)
    server.add("POST", "/large", echo)
    port = await server.start("127.0.0.1", 0)
    try:
        yield server, port
    finally:
        await server.stop()


async def exchange(port: int, sent: bytes) -> bytes:
    """Send ``sent``, then read the answer until the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(sent)
        await writer.drain()
        async with asyncio.timeout(REQUEST_TIMEOUT + 5):
            return await reader.read()
    finally:
        writer.close()


async def test_a_16_mib_body_on_get_healthz_is_refused_before_it_is_sent(
    endpoint: tuple[HttpEndpoint, int],
) -> None:
    _, port = endpoint
    head = f"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: {16 * 1024 * 1024}\r\n\r\n"
    # only the headers go out: the answer comes without the server waiting for the body
    answer = await exchange(port, head.encode())
    assert answer.startswith(b"HTTP/1.1 413 ")
    assert b"at most 0 bytes" in answer


async def test_a_body_over_the_routes_cap_is_refused_and_one_within_is_served(
    endpoint: tuple[HttpEndpoint, int],
) -> None:
    _, port = endpoint
    over = await exchange(port, b"POST /echo HTTP/1.1\r\nContent-Length: 1025\r\n\r\n")
    assert over.startswith(b"HTTP/1.1 413 ")
    within = await exchange(port, b"POST /echo HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc")
    assert within.startswith(b"HTTP/1.1 200 ") and within.endswith(b"\r\n\r\n3\n")
    default = await exchange(
        port, f"POST /large HTTP/1.1\r\nContent-Length: {MAX_BODY + 1}\r\n\r\n".encode()
    )
    assert default.startswith(b"HTTP/1.1 413 ")


@pytest.mark.parametrize(
    "sent",
    [
        pytest.param(
            b"GET /healthz HTTP/1.1\r\nX-Long: " + b"a" * (MAX_LINE_BYTES + 1) + b"\r\n\r\n",
            id="one-long-header-line",
        ),
        pytest.param(
            b"GET /healthz HTTP/1.1\r\n"
            + b"".join(
                b"X-H%d: %s\r\n" % (i, b"b" * 1000) for i in range(MAX_HEADER_BYTES // 1000 + 2)
            )
            + b"\r\n",
            id="many-headers",
        ),
        pytest.param(
            b"GET /" + b"c" * (MAX_LINE_BYTES + 1) + b" HTTP/1.1\r\n\r\n", id="long-target"
        ),
    ],
)
async def test_oversized_headers_are_refused_with_431(
    endpoint: tuple[HttpEndpoint, int], sent: bytes
) -> None:
    _, port = endpoint
    answer = await exchange(port, sent)
    assert answer.startswith(b"HTTP/1.1 431 ")


async def test_a_chunked_body_is_refused_with_411(endpoint: tuple[HttpEndpoint, int]) -> None:
    _, port = endpoint
    answer = await exchange(
        port, b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
    )
    assert answer.startswith(b"HTTP/1.1 411 ")


async def test_connections_beyond_the_cap_get_503_at_once_and_the_cap_frees_up(
    endpoint: tuple[HttpEndpoint, int],
) -> None:
    server, port = endpoint
    release = asyncio.Event()
    all_held = asyncio.Event()
    held = 0

    async def hold(_: bytes) -> tuple[int, str, bytes]:
        nonlocal held
        held += 1
        if held == MAX_CONNECTIONS:
            all_held.set()
        await release.wait()
        return 200, "text/plain", b"released\n"

    server.add("GET", "/hold", hold)
    holding = [
        asyncio.create_task(exchange(port, b"GET /hold HTTP/1.1\r\n\r\n"))
        for _ in range(MAX_CONNECTIONS)
    ]
    try:
        async with asyncio.timeout(10):
            await all_held.wait()
        # (it sends nothing: unread bytes would turn the server's close into a reset)
        refused = await exchange(port, b"")
        assert refused.startswith(b"HTTP/1.1 503 ")
        assert server.refused_connections == 1
        release.set()
        answers = await asyncio.gather(*holding)
        assert all(a.startswith(b"HTTP/1.1 200 ") for a in answers)
        served = await exchange(port, b"GET /healthz HTTP/1.1\r\n\r\n")
        assert served.startswith(b"HTTP/1.1 200 ")
    finally:
        release.set()
        for task in holding:
            task.cancel()


async def test_a_client_that_keeps_trickling_its_headers_is_cut_off_at_the_deadline(
    endpoint: tuple[HttpEndpoint, int],
) -> None:
    _, port = endpoint
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    loop = asyncio.get_running_loop()
    started = loop.time()
    writer.write(b"GET /healthz HTTP/1.1\r\n")
    answer = b""
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT + 5):
            while not answer:
                writer.write(b"X-Slow: 1\r\n")  # a header line every 50 ms, never the end
                await writer.drain()
                try:
                    async with asyncio.timeout(0.05):
                        answer = await reader.read(1024)
                except TimeoutError:
                    continue
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert loop.time() - started >= REQUEST_TIMEOUT


async def test_the_console_refuses_a_header_block_over_its_cap() -> None:
    import socket

    import uvicorn

    from gpupool.console import __main__ as console

    async def app(scope: dict[str, object], receive: object, send: object) -> None:
        assert scope["type"] in ("http", "lifespan")
        if scope["type"] == "lifespan":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})  # type: ignore[operator]
        await send({"type": "http.response.body", "body": b"ok"})  # type: ignore[operator]

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    config = console.bounded_config(app)
    config.lifespan = "off"
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[listener]))
    try:
        # the listener listens already: a connection waits in its backlog until uvicorn serves
        ok = await exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert ok.startswith(b"HTTP/1.1 200 ")
        big = b"".join(
            b"X-H%d: %s\r\n" % (i, b"b" * 1000) for i in range(console.MAX_HEADER_BYTES // 1000 + 2)
        )
        # never ending its headers: h11 buffers at most the cap, then answers 400 and closes
        refused = await exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n" + big)
        assert refused.startswith(b"HTTP/1.1 400 ")
    finally:
        server.should_exit = True
        await serving
