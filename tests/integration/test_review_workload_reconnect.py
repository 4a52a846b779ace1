"""``gpupool run`` reconnects each time it loses the executor, not only within the window
after the first loss.

A stand-in executor on a real Unix socket: the first connection says Started and hangs up
(a crash); the client reattaches; that connection lives longer than the reconnect window
and then hangs up too (a second crash, much later); the third connection says Exited.
The client must reattach again and return the command's exit code.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpupool.events import PodRef
from gpupool.workload import (
    ExecutorMessage,
    Exited,
    RunRequest,
    Started,
    decode_request,
    encode_line,
    run_workload,
)

pytestmark = pytest.mark.integration

RECONNECT_SECONDS = 0.5


@pytest.fixture
def devnull() -> Iterator[int]:
    fd = os.open(os.devnull, os.O_RDWR)
    yield fd
    os.close(fd)


async def test_the_client_reattaches_after_a_second_loss_long_after_the_first(
    tmp_path: Path, devnull: int
) -> None:
    path = tmp_path / "executor.sock"
    loop = asyncio.get_running_loop()
    requests: list[RunRequest] = []
    window_passed = asyncio.Event()

    async def executor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests.append(decode_request(await reader.readline()))
        attempt = len(requests)
        if attempt == 1:
            writer.write(encode_line(Started(gpu_index=0, gpu_uuid="GPU-x", pid=4242)))
        elif attempt == 2:
            # The reattached run goes on past the reconnect window (the point of the test is
            # time passing, so a timer is the condition), then this executor crashes too.
            loop.call_later(RECONNECT_SECONDS * 2, window_passed.set)
            await window_passed.wait()
        else:
            writer.write(encode_line(Exited(exit_code=7, reason="failed")))
        await writer.drain()
        writer.close()

    server = await asyncio.start_unix_server(executor, path=str(path))
    messages: list[ExecutorMessage] = []
    try:
        async with asyncio.timeout(10):
            code = await run_workload(
                path,
                RunRequest(
                    pod=PodRef(namespace="default", name="p"), argv=["true"], cwd="/", env={}
                ),
                on_message=messages.append,
                fds=(devnull, devnull, devnull),
                reconnect_seconds=RECONNECT_SECONDS,
            )
    finally:
        server.close()
        await server.wait_closed()

    assert code == 7
    assert [r.reattach for r in requests] == [False, True, True]
    assert isinstance(messages[-1], Exited)
