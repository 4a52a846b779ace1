"""Hostile clients at the workload socket: every refusal answered and recorded, nothing fatal.

A real Unix socket and real clients (in this process); the handler is a stand-in that answers
a valid request at once, so what is checked is the server's own bounds: fds per connection,
partial frames, deep nesting, connections per uid, the connection rate per uid, bytes after the
request, and the aggregation of a flood of refusals into one summary per interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import textwrap
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import msgspec
import pytest

from gpupool.events import PodRef
from gpupool.node_executor.peer_identity import PeerIdentity
from gpupool.node_executor.socket_refusals import RefusalSummary
from gpupool.node_executor.workload_socket import Channel, SocketLimits, WorkloadSocketServer
from gpupool.workload import (
    AttachRequest,
    Exited,
    Rejected,
    RunRequest,
    StdioFds,
    decode_executor_message,
    encode_line,
    run_workload,
)

pytestmark = pytest.mark.integration

TIMEOUT = 10.0
REQUEST = RunRequest(
    pod=PodRef(namespace="default", name="p"), argv=["true"], cwd="/", env={}, requeue=False
)


class AnsweringHandler:
    """Answers every valid request at once: the bounds under test are the server's."""

    def __init__(self) -> None:
        self.requests: list[RunRequest | AttachRequest] = []

    async def handle(self, request: RunRequest, fds: StdioFds, channel: Channel) -> None:
        self.requests.append(request)
        await channel.send(Exited(exit_code=0, reason="completed"))

    async def attach(self, request: AttachRequest, channel: Channel) -> None:
        self.requests.append(request)
        await channel.send(Rejected(reason="NoGpuHere", message="a stand-in"))


class Records:
    """What the server had recorded: each refusal, and the summaries."""

    def __init__(self) -> None:
        self.one: list[tuple[str, str]] = []
        self.summaries: list[RefusalSummary] = []
        self._changed = asyncio.Event()

    async def record_one(self, peer: PeerIdentity, data: bytes, reason: str, message: str) -> None:
        self.one.append((reason, message))
        self._changed.set()

    async def record_summary(self, summary: RefusalSummary) -> None:
        self.summaries.append(summary)
        self._changed.set()

    async def until(self, done: Callable[[], bool]) -> None:
        """The recording runs in the background: wait (bounded) until ``done()``."""
        async with asyncio.timeout(TIMEOUT):
            while not done():
                self._changed.clear()
                await self._changed.wait()

    def recorded(self) -> int:
        return len(self.one) + sum(s.refusals for s in self.summaries)


@pytest.fixture
def devnull() -> Iterator[int]:
    fd = os.open(os.devnull, os.O_RDONLY)
    yield fd
    os.close(fd)


@contextlib.asynccontextmanager
async def serving(
    path: Path, **options: object
) -> AsyncIterator[tuple[WorkloadSocketServer, AnsweringHandler, Records]]:
    handler = AnsweringHandler()
    records = Records()
    server = WorkloadSocketServer(
        path,
        handler,
        on_rejected=records.record_one,
        on_summary=records.record_summary,
        **options,  # type: ignore[arg-type]
    )
    async with server:
        yield server, handler, records


async def exchange(
    path: Path, payload: bytes, fds: list[int] | None = None, *, shut_write: bool = False
) -> bytes:
    """Send ``payload`` (fds with its first byte) as a misbehaving client would; the reply."""
    loop = asyncio.get_running_loop()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.setblocking(False)
        await loop.sock_connect(sock, str(path))
        with contextlib.suppress(BrokenPipeError, ConnectionError):
            if fds:
                socket.send_fds(sock, [payload[:1] or b" "], fds)
                payload = payload[1:]
            if payload:
                await loop.sock_sendall(sock, payload)
            if shut_write:
                sock.shutdown(socket.SHUT_WR)
        reply = b""
        async with asyncio.timeout(TIMEOUT):
            while not reply.endswith(b"\n"):
                try:
                    chunk = await loop.sock_recv(sock, 65536)
                except ConnectionError:
                    break
                if not chunk:
                    break
                reply += chunk
        return reply


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def wait_recorded(server: WorkloadSocketServer, records: Records, count: int) -> None:
    await records.until(lambda: records.recorded() >= count)


async def test_a_flood_of_passed_fds_is_refused_and_every_fd_closed(
    tmp_path: Path, devnull: int
) -> None:
    path = tmp_path / "s.sock"
    async with serving(path) as (server, handler, records):
        before = open_fds()
        many = [devnull] * 200
        replies = [
            decode_executor_message(await exchange(path, encode_line(REQUEST), many))
            for _ in range(30)  # 6,000 descriptors
        ]
        assert all(r == replies[0] for r in replies)
        assert isinstance(replies[0], Rejected) and replies[0].reason == "too-many-fds"
        await wait_recorded(server, records, 30)
        assert open_fds() <= before + 1  # nothing kept (at most the refusal log's task)
        assert handler.requests == []
        # and the server still serves a proper request
        code = await run_workload(path, REQUEST, on_message=lambda m: None, fds=(devnull,) * 3)
        assert code == 0


async def test_a_partial_frame_and_deep_nesting_are_answered_and_recorded(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    async with serving(path) as (server, _, records):
        partial = decode_executor_message(
            await exchange(path, encode_line(REQUEST)[:40], shut_write=True)
        )
        nested = decode_executor_message(
            await exchange(path, b'{"type":"AttachRequest","pid":' + b"[" * 5000 + b"\n")
        )
        deep_but_closed = b'{"type":"AttachRequest","pid":1,"x":' + b"[" * 100_000 + b"]" * 100_000
        nested_valid_json = decode_executor_message(await exchange(path, deep_but_closed + b"}\n"))
        await wait_recorded(server, records, 3)
    assert partial == Rejected(
        reason="partial-request",
        message="the connection ended 40 bytes into a request, before its newline",
    )
    assert isinstance(nested, Rejected) and nested.reason == "bad-request"
    assert isinstance(nested_valid_json, Rejected) and nested_valid_json.reason == "bad-request"
    assert "nested too deeply" in nested_valid_json.message
    assert [reason for reason, _ in records.one] == [
        "partial-request",
        "bad-request",
        "bad-request",
    ]


async def test_connections_per_uid_are_capped(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    limits = SocketLimits(max_connections_per_uid=3)
    async with serving(path, limits=limits) as (server, _, records):
        loop = asyncio.get_running_loop()
        silent = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(3)]
        try:
            for sock in silent:
                sock.setblocking(False)
                await loop.sock_connect(sock, str(path))
            # accepted in order: the three are admitted before the next connection
            refused = decode_executor_message(await exchange(path, encode_line(REQUEST)))
        finally:
            for sock in silent:
                sock.close()
        assert isinstance(refused, Rejected) and refused.reason == "too-many-connections"
        await wait_recorded(server, records, 1)


async def test_a_flood_of_refusals_costs_one_summary_per_interval_and_loses_no_count(
    tmp_path: Path,
) -> None:
    path = tmp_path / "s.sock"
    limits = SocketLimits(connections_per_second_per_uid=0.001, connection_burst_per_uid=5)
    async with serving(
        path, limits=limits, refusal_interval_seconds=60.0, refusals_recorded_individually=3
    ) as (server, _, records):
        replies = [decode_executor_message(await exchange(path, b"garbage\n")) for _ in range(200)]
        reasons = [r.reason for r in replies if isinstance(r, Rejected)]
        assert reasons[:5] == ["bad-request"] * 5  # the burst, then the rate limit
        assert set(reasons[5:]) == {"rate-limited"} and len(reasons) == 200
        await wait_recorded(server, records, 3)
        assert records.summaries == []  # the flood's interval is not over
    # closing the server records what was counted, as one summary
    assert len(records.one) == 3
    (summary,) = records.summaries
    uid = os.getuid()
    assert summary.refusals == 197
    assert summary.by_reason == {"bad-request": 2, "rate-limited": 195}
    assert summary.by_peer == {f"uid {uid} pid {os.getpid()}": 197}
    assert server.refusals.total == {"bad-request": 5, "rate-limited": 195}


async def test_the_summary_is_recorded_when_its_interval_ends(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    async with serving(path, refusal_interval_seconds=0.3, refusals_recorded_individually=1) as (
        _,
        _,
        records,
    ):
        for _ in range(4):
            await exchange(path, b"{}\n")
        await records.until(lambda: bool(records.summaries))  # when the interval has ended
        assert records.summaries[0].refusals == 3
        assert records.summaries[0].describe().startswith("SocketRefusals: 3 more refusals in ")


async def test_bytes_after_the_request_are_cut_off_and_recorded(
    tmp_path: Path, devnull: int
) -> None:
    class Waiter(AnsweringHandler):
        async def handle(self, request: RunRequest, fds: StdioFds, channel: Channel) -> None:
            await channel.wait_client_gone()

    path = tmp_path / "s.sock"
    records = Records()
    server = WorkloadSocketServer(
        path,
        Waiter(),
        limits=SocketLimits(max_bytes_after_request=1000),
        on_rejected=records.record_one,
    )
    async with server:
        loop = asyncio.get_running_loop()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.setblocking(False)
            await loop.sock_connect(sock, str(path))
            socket.send_fds(sock, [encode_line(REQUEST)], [devnull] * 3)
            with contextlib.suppress(ConnectionError):
                await loop.sock_sendall(sock, b"x" * 5000)
            async with asyncio.timeout(TIMEOUT):
                while await loop.sock_recv(sock, 4096):
                    pass  # until the server hangs up
        await wait_recorded(server, records, 1)
    assert records.one[0][0] == "unexpected-data"


SERVER_WITH_FEW_FDS = textwrap.dedent(
    """
    import asyncio, resource, sys
    from gpupool.node_executor.workload_socket import WorkloadSocketServer, SocketLimits
    from gpupool.workload import Exited

    class Answer:
        async def handle(self, request, fds, channel):
            await channel.send(Exited(exit_code=0, reason="completed"))
        async def attach(self, request, channel):
            pass

    async def main():
        resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))
        refused = []
        async def record(peer, data, reason, message):
            refused.append(reason)
        limits = SocketLimits(fd_reserve=8, fds_per_connection=1, request_timeout_seconds=1.0)
        async with WorkloadSocketServer(sys.argv[1], Answer(), limits=limits, on_rejected=record):
            print("serving", flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        print("refused", sorted(set(refused)), flush=True)

    asyncio.run(main())
    """
)


async def test_out_of_descriptors_the_server_refuses_connections_and_keeps_serving(
    tmp_path: Path, devnull: int
) -> None:
    """48 descriptors in all: 300 silent connections cannot exhaust them."""
    path = tmp_path / "s.sock"
    server = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        SERVER_WITH_FEW_FDS,
        str(path),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert server.stdin is not None and server.stdout is not None
    loop = asyncio.get_running_loop()
    held: list[socket.socket] = []
    try:
        async with asyncio.timeout(TIMEOUT):
            assert await server.stdout.readline() == b"serving\n"
        for _ in range(300):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            held.append(sock)
            # a blocking connect waits while the listen backlog is full (a non-blocking one
            # would fail with EAGAIN and leave the socket unconnected)
            await loop.run_in_executor(None, sock.connect, str(path))
            sock.setblocking(False)

        async def reason(sock: socket.socket) -> str:
            async with asyncio.timeout(TIMEOUT):
                reply = await loop.sock_recv(sock, 4096)
            return msgspec.json.decode(reply, type=Rejected).reason

        reasons = await asyncio.gather(*(reason(sock) for sock in held))
        # the ones it could take wait for their request (and time out); the rest are refused
        assert reasons.count("overloaded") >= 250
        assert set(reasons) == {"overloaded", "request-timeout"}
        for sock in held:
            sock.close()
        held.clear()
        code = await run_workload(
            path, REQUEST, on_message=lambda m: None, fds=(devnull,) * 3, reconnect_seconds=5
        )
        assert code == 0
        assert server.returncode is None  # it is still running
        server.stdin.write(b"stop\n")
        await server.stdin.drain()
        async with asyncio.timeout(TIMEOUT):
            out = (await server.stdout.read()).decode()
            assert await server.wait() == 0
        assert "'overloaded'" in out  # recorded (the first ones one by one)
    finally:
        for sock in held:
            sock.close()
        if server.returncode is None:
            server.kill()
            await server.wait()
