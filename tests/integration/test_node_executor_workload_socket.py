"""End to end over a real Unix socket: a real client passes its stdio, a real command runs.

The handler here is a test double for the service glue (which consumes Assigned/Preempted from
the event log): the test drives it with commands, as the log would, and it uses the real
ProcessSupervisor and workload_environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest

from gpupool.events import GpuInfo, PodRef, ReleaseReason, Share
from gpupool.node_executor.environment import workload_environment
from gpupool.node_executor.peer_identity import PeerIdentity, cgroup_of
from gpupool.node_executor.processes import (
    ProcessSupervisor,
    Termination,
    WorkloadStartFailed,
)
from gpupool.node_executor.workload_socket import Channel, WorkloadSocketServer
from gpupool.workload import (
    EXIT_EXECUTOR_UNAVAILABLE,
    EXIT_PREEMPTED,
    ExecutorMessage,
    ExecutorUnavailable,
    Exited,
    Preempted,
    Rejected,
    RunRequest,
    Started,
    StdioFds,
    Waiting,
    decode_executor_message,
    encode_line,
    run_workload,
)

pytestmark = pytest.mark.integration

TIMEOUT = 10.0
POD = PodRef(namespace="team-a", name="trainer")
GPU = GpuInfo(index=3, uuid="GPU-SIMULATED-node1-3", memory_mib=81559)
LIMITS = Share(core=30, memory=25)


# --------------------------------------------------------------------------- the test double


class Wait(msgspec.Struct, frozen=True):
    seconds: int
    position: int


class Assign(msgspec.Struct, frozen=True):
    gpu: GpuInfo
    limits: Share


class Preempt(msgspec.Struct, frozen=True):
    by: str


Command = Wait | Assign | Preempt


class Release(msgspec.Struct, frozen=True):
    pod: PodRef
    reason: ReleaseReason
    exit_code: int | None


class FakeHandler:
    """Stands in for the glue: Wait/Assign/Preempt commands play the role of log events."""

    def __init__(self, *, grace_seconds: float = 0.3) -> None:
        self.commands: asyncio.Queue[Command] = asyncio.Queue()
        self.releases: asyncio.Queue[Release] = asyncio.Queue()
        self.terminations: list[Termination] = []
        self.peers: list[PeerIdentity] = []
        self.requests: list[RunRequest] = []
        self.started: list[int] = []
        self.connected = asyncio.Event()
        self.supervisor = ProcessSupervisor()
        self.grace_seconds = grace_seconds

    async def _next(self, channel: Channel) -> Command | None:
        """The next command, or None when the client went away first."""
        command = asyncio.ensure_future(self.commands.get())
        gone = asyncio.ensure_future(channel.wait_client_gone())
        await asyncio.wait({command, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if command.done():
            return command.result()
        command.cancel()
        return None

    async def handle(self, request: RunRequest, fds: StdioFds, channel: Channel) -> None:
        self.requests.append(request)
        self.peers.append(channel.peer)
        self.connected.set()
        while True:
            command = await self._next(channel)
            if command is None:
                await self.releases.put(Release(request.pod, "cancelled", None))
                return
            if isinstance(command, Wait):
                await channel.send(Waiting(seconds=command.seconds, position=command.position))
                continue
            assert isinstance(command, Assign), command
            env = workload_environment(request.env, command.gpu, command.limits, pod=request.pod)
            try:
                workload = await self.supervisor.start(
                    request.pod,
                    request.argv,
                    env,
                    request.cwd,
                    fds,
                    run_as=(channel.peer.uid, channel.peer.gid),
                )
            except WorkloadStartFailed as error:
                await self.releases.put(Release(request.pod, "failed", error.exit_code))
                await channel.send(Exited(exit_code=error.exit_code, reason="failed"))
                return
            self.started.append(workload.pid)
            await channel.send(
                Started(gpu_index=command.gpu.index, gpu_uuid=command.gpu.uuid, pid=workload.pid)
            )
            exited = asyncio.ensure_future(self.supervisor.wait(workload))
            interrupt = asyncio.ensure_future(self._next(channel))
            await asyncio.wait({exited, interrupt}, return_when=asyncio.FIRST_COMPLETED)
            if exited.done():
                interrupt.cancel()
                code = exited.result()
                self.terminations.append(await self.supervisor.terminate(workload, 0))
                reason: ReleaseReason = "completed" if code == 0 else "failed"
                await self.releases.put(Release(request.pod, reason, code))
                await channel.send(Exited(exit_code=code, reason=reason))
                return
            exited.cancel()
            preempt = interrupt.result()
            if preempt is not None:
                assert isinstance(preempt, Preempt), preempt
                await channel.send(Preempted(by=preempt.by, gpu_index=command.gpu.index))
            termination = await self.supervisor.terminate(workload, self.grace_seconds)
            self.terminations.append(termination)
            if preempt is None:
                await self.releases.put(Release(request.pod, "cancelled", termination.exit_code))
                return
            await self.releases.put(Release(request.pod, "preempted", termination.exit_code))
            if not request.requeue:
                await channel.send(Exited(exit_code=termination.exit_code, reason="preempted"))
                return


class BrokenHandler:
    async def handle(self, request: RunRequest, fds: StdioFds, channel: Channel) -> None:
        raise RuntimeError("the glue fell over")


# --------------------------------------------------------------------------- fixtures


class Pipe:
    """A pipe whose write end is given to the client as stdout and stderr."""

    def __init__(self, reader: asyncio.StreamReader, write_fd: int) -> None:
        self.reader = reader
        self.write_fd = write_fd

    async def line(self) -> str:
        async with asyncio.timeout(TIMEOUT):
            return (await self.reader.readline()).decode().rstrip("\n")

    async def rest(self) -> str:
        async with asyncio.timeout(TIMEOUT):
            return (await self.reader.read()).decode()

    def close_write_end(self) -> None:
        if self.write_fd >= 0:
            os.close(self.write_fd)
            self.write_fd = -1


@pytest.fixture
async def pipe() -> AsyncIterator[Pipe]:
    read_fd, write_fd = os.pipe()
    reader = asyncio.StreamReader()
    transport, _ = await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(read_fd, "rb", buffering=0)
    )
    pipe = Pipe(reader, write_fd)
    yield pipe
    transport.close()
    pipe.close_write_end()


@pytest.fixture
def devnull() -> Iterator[int]:
    fd = os.open(os.devnull, os.O_RDONLY)
    yield fd
    os.close(fd)


@pytest.fixture
def socket_path(tmp_path: Path) -> Path:
    return tmp_path / "workload.sock"


@pytest.fixture
async def handler(socket_path: Path) -> AsyncIterator[FakeHandler]:
    handler = FakeHandler()
    async with WorkloadSocketServer(socket_path, handler):
        yield handler


class Inbox:
    """Messages the client received, awaitable one by one."""

    def __init__(self) -> None:
        self.messages: list[ExecutorMessage] = []
        self._queue: asyncio.Queue[ExecutorMessage] = asyncio.Queue()

    def __call__(self, message: ExecutorMessage) -> None:
        self.messages.append(message)
        self._queue.put_nowait(message)

    async def next(self) -> ExecutorMessage:
        async with asyncio.timeout(TIMEOUT):
            return await self._queue.get()


def request_for(argv: list[str], *, requeue: bool = False, cwd: str = "/") -> RunRequest:
    return RunRequest(
        pod=POD,
        argv=argv,
        cwd=cwd,
        env={"PATH": os.environ["PATH"], "CUDA_VISIBLE_DEVICES": "0,1", "USER_VAR": "kept"},
        requeue=requeue,
    )


async def released(handler: FakeHandler) -> Release:
    async with asyncio.timeout(TIMEOUT):
        return await handler.releases.get()


# --------------------------------------------------------------------------- tests

PRINT_ENV = """
import os, sys
for name in ("CUDA_VISIBLE_DEVICES", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
             "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "GPUPOOL_POD", "GPUPOOL_GPU_INDEX",
             "GPUPOOL_GPU_UUID", "USER_VAR"):
    print(name, os.environ.get(name), flush=True)
print("cwd", os.getcwd(), flush=True)
sys.exit(3)
"""


async def test_waits_then_runs_the_command_with_its_gpu_and_limits_on_the_clients_stdout(
    handler: FakeHandler, socket_path: Path, pipe: Pipe, devnull: int, tmp_path: Path
) -> None:
    inbox = Inbox()
    client = asyncio.create_task(
        run_workload(
            socket_path,
            request_for([sys.executable, "-c", PRINT_ENV], cwd=str(tmp_path)),
            on_message=inbox,
            fds=(devnull, pipe.write_fd, pipe.write_fd),
        )
    )
    await handler.commands.put(Wait(0, 2))
    assert await inbox.next() == Waiting(seconds=0, position=2)
    await handler.commands.put(Wait(10, 1))
    assert await inbox.next() == Waiting(seconds=10, position=1)
    await handler.commands.put(Assign(GPU, LIMITS))

    started = await inbox.next()
    assert isinstance(started, Started)
    assert (started.gpu_index, started.gpu_uuid) == (3, "GPU-SIMULATED-node1-3")
    assert [await pipe.line() for _ in range(8)] == [
        "CUDA_VISIBLE_DEVICES GPU-SIMULATED-node1-3",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE 30",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT 0=20389M",  # 25% of 81559 MiB, floored
        "GPUPOOL_POD team-a/trainer",
        "GPUPOOL_GPU_INDEX 3",
        "GPUPOOL_GPU_UUID GPU-SIMULATED-node1-3",
        "USER_VAR kept",
        f"cwd {tmp_path}",
    ]
    async with asyncio.timeout(TIMEOUT):
        assert await client == 3
    assert inbox.messages[-1] == Exited(exit_code=3, reason="failed")
    assert await released(handler) == Release(POD, "failed", 3)
    # Every copy of the client's stdout is closed (the server's and the command's):
    pipe.close_write_end()
    assert await pipe.rest() == ""


async def test_completed_command_exits_zero(
    handler: FakeHandler, socket_path: Path, pipe: Pipe, devnull: int
) -> None:
    inbox = Inbox()
    client = asyncio.create_task(
        run_workload(
            socket_path,
            request_for([sys.executable, "-c", "print('done')"]),
            on_message=inbox,
            fds=(devnull, pipe.write_fd, pipe.write_fd),
        )
    )
    await handler.commands.put(Assign(GPU, LIMITS))
    assert await pipe.line() == "done"
    async with asyncio.timeout(TIMEOUT):
        assert await client == 0
    assert await released(handler) == Release(POD, "completed", 0)


STUBBORN = """
import signal
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
while True:
    signal.pause()
"""


async def test_preempted_command_is_killed_and_client_exits_tempfail(
    handler: FakeHandler, socket_path: Path, pipe: Pipe, devnull: int
) -> None:
    inbox = Inbox()
    client = asyncio.create_task(
        run_workload(
            socket_path,
            request_for([sys.executable, "-c", STUBBORN]),
            on_message=inbox,
            fds=(devnull, pipe.write_fd, pipe.write_fd),
        )
    )
    await handler.commands.put(Assign(GPU, LIMITS))
    started = await inbox.next()
    assert isinstance(started, Started)
    assert await pipe.line() == "ready"

    await handler.commands.put(Preempt(by="urgent-pod"))

    assert await inbox.next() == Preempted(by="urgent-pod", gpu_index=3)
    async with asyncio.timeout(TIMEOUT):
        assert await client == EXIT_PREEMPTED
    assert inbox.messages[-1] == Exited(exit_code=137, reason="preempted")
    assert await released(handler) == Release(POD, "preempted", 137)
    [termination] = handler.terminations
    assert termination.ended_by == "SIGKILL"
    assert termination.confirmed
    assert _gone(started.pid)


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (an orphan is reaped by init, not by us)."""
    with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/stat") as stat_file:
        return stat_file.read().rpartition(")")[2].split()[0] in ("Z", "X")
    return True


async def test_requeued_after_preemption_runs_again(
    handler: FakeHandler, socket_path: Path, pipe: Pipe, devnull: int
) -> None:
    inbox = Inbox()
    code = "import signal; print('ready', flush=True); signal.pause()"
    client = asyncio.create_task(
        run_workload(
            socket_path,
            request_for([sys.executable, "-c", code], requeue=True),
            on_message=inbox,
            fds=(devnull, pipe.write_fd, pipe.write_fd),
        )
    )
    await handler.commands.put(Assign(GPU, LIMITS))
    assert isinstance(await inbox.next(), Started)
    assert await pipe.line() == "ready"
    await handler.commands.put(Preempt(by="urgent-pod"))
    assert await inbox.next() == Preempted(by="urgent-pod", gpu_index=3)
    assert await released(handler) == Release(POD, "preempted", 143)  # obeyed SIGTERM

    await handler.commands.put(Wait(1, 1))
    assert await inbox.next() == Waiting(seconds=1, position=1)
    other_gpu = GpuInfo(index=0, uuid="GPU-SIMULATED-node1-0", memory_mib=81559)
    handler.commands.put_nowait(Assign(other_gpu, LIMITS))
    started = await inbox.next()
    assert isinstance(started, Started)
    assert started.gpu_index == 0
    assert await pipe.line() == "ready"
    await handler.commands.put(Preempt(by="another"))
    assert await inbox.next() == Preempted(by="another", gpu_index=0)
    assert not client.done()  # still re-queued: the client waits for the next assignment
    client.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await client
    assert await released(handler) == Release(POD, "preempted", 143)
    assert await released(handler) == Release(POD, "cancelled", None)


async def test_client_leaving_while_waiting_cancels(
    handler: FakeHandler, socket_path: Path, pipe: Pipe, devnull: int
) -> None:
    inbox = Inbox()
    client = asyncio.create_task(
        run_workload(
            socket_path,
            request_for(["true"]),
            on_message=inbox,
            fds=(devnull, pipe.write_fd, pipe.write_fd),
        )
    )
    await handler.commands.put(Wait(0, 1))
    await inbox.next()
    client.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await client
    assert await released(handler) == Release(POD, "cancelled", None)


async def test_client_leaving_while_running_ends_the_command(
    handler: FakeHandler, socket_path: Path, pipe: Pipe, devnull: int
) -> None:
    inbox = Inbox()
    code = "import signal; print('ready', flush=True); signal.pause()"
    client = asyncio.create_task(
        run_workload(
            socket_path,
            request_for([sys.executable, "-c", code]),
            on_message=inbox,
            fds=(devnull, pipe.write_fd, pipe.write_fd),
        )
    )
    await handler.commands.put(Assign(GPU, LIMITS))
    assert await pipe.line() == "ready"
    client.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await client
    assert await released(handler) == Release(POD, "cancelled", 143)


async def test_command_that_cannot_start_fails_with_127(
    handler: FakeHandler, socket_path: Path, pipe: Pipe, devnull: int
) -> None:
    inbox = Inbox()
    client = asyncio.create_task(
        run_workload(
            socket_path,
            request_for(["/nonexistent/train.py"]),
            on_message=inbox,
            fds=(devnull, pipe.write_fd, pipe.write_fd),
        )
    )
    await handler.commands.put(Assign(GPU, LIMITS))
    async with asyncio.timeout(TIMEOUT):
        assert await client == 127
    assert inbox.messages == [Exited(exit_code=127, reason="failed")]


async def test_peer_credentials_and_cgroup_come_from_the_kernel(
    handler: FakeHandler, socket_path: Path, pipe: Pipe, devnull: int
) -> None:
    client = asyncio.create_task(
        run_workload(
            socket_path,
            request_for(["true"]),
            on_message=Inbox(),
            fds=(devnull, pipe.write_fd, pipe.write_fd),
        )
    )
    async with asyncio.timeout(TIMEOUT):
        await handler.connected.wait()
    [peer] = handler.peers
    assert (peer.pid, peer.uid, peer.gid) == (os.getpid(), os.getuid(), os.getgid())
    assert peer.cgroup == cgroup_of(os.getpid())
    client.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await client


async def test_gpupool_run_process_prints_the_exact_waiting_line_and_returns_the_exit_code(
    handler: FakeHandler, socket_path: Path, pipe: Pipe, devnull: int
) -> None:
    """A real ``gpupool run`` process: its stdout carries the waiting lines and the command's."""
    gpupool_run = (
        "import sys; from gpupool.workload import run_main; sys.exit(run_main(sys.argv[1:]))"
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        gpupool_run,
        "--pod",
        "trainer",
        "--namespace",
        "team-a",
        "--socket",
        str(socket_path),
        "--",
        sys.executable,
        "-c",
        "print('hello from the GPU'); raise SystemExit(5)",
        stdin=devnull,
        stdout=pipe.write_fd,
        stderr=pipe.write_fd,
    )
    pipe.close_write_end()
    await handler.commands.put(Wait(20, 2))
    assert await pipe.line() == "You have been waiting for 20 seconds. Approximate position: 2"
    await handler.commands.put(Assign(GPU, LIMITS))
    started_line = await pipe.line()
    assert started_line == f"gpupool: running on GPU 3 ({GPU.uuid}) as pid {handler.started[0]}"
    assert await pipe.line() == "hello from the GPU"
    async with asyncio.timeout(TIMEOUT):
        assert await process.wait() == 5
    assert await released(handler) == Release(POD, "failed", 5)
    assert handler.peers[0].pid == process.pid
    assert handler.requests[0].pod == POD
    assert handler.requests[0].argv[-1] == "print('hello from the GPU'); raise SystemExit(5)"
    assert await pipe.rest() == ""  # nothing else: no stray output from gpupool run


# --------------------------------------------------------------------------- robustness


async def raw_exchange(socket_path: Path, payload: bytes, fds: list[int] | None = None) -> bytes:
    """Send ``payload`` (with ``fds``) as a misbehaving client would; the reply line."""
    loop = asyncio.get_running_loop()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.setblocking(False)
        await loop.sock_connect(sock, str(socket_path))
        if fds:
            socket.send_fds(sock, [payload], fds)
            sending = None
        else:
            sending = asyncio.create_task(loop.sock_sendall(sock, payload))
        try:
            async with asyncio.timeout(TIMEOUT):
                reply = b""
                while not reply.endswith(b"\n"):
                    chunk = await loop.sock_recv(sock, 65536)
                    if not chunk:
                        break
                    reply += chunk
                return reply
        finally:
            if sending is not None:
                sending.cancel()
                # The server may hang up on a client still sending: that is the point.
                with contextlib.suppress(asyncio.CancelledError, BrokenPipeError, ConnectionError):
                    await sending


@pytest.mark.parametrize(
    ("payload", "with_fds", "reason"),
    [
        pytest.param(b"not json at all\n", True, "bad-request", id="garbage"),
        pytest.param(
            b'{"type": "Waiting", "seconds": 1, "position": 1}\n',
            True,
            "bad-request",
            id="wrong-type",
        ),
        pytest.param(
            b'{"type": "RunRequest", "pod": {"namespace": "a"}}\n',
            True,
            "bad-request",
            id="missing-fields",
        ),
        pytest.param(encode_line(request_for(["true"])), False, "bad-fds", id="no-fds"),
    ],
)
async def test_bad_requests_are_rejected_and_the_server_keeps_serving(
    handler: FakeHandler,
    socket_path: Path,
    devnull: int,
    pipe: Pipe,
    payload: bytes,
    with_fds: bool,
    reason: str,
) -> None:
    reply = await raw_exchange(
        socket_path, payload, [devnull, devnull, devnull] if with_fds else None
    )
    rejected = decode_executor_message(reply)
    assert isinstance(rejected, Rejected)
    assert rejected.reason == reason
    assert handler.requests == []

    client = asyncio.create_task(
        run_workload(
            socket_path,
            request_for([sys.executable, "-c", "print('still serving')"]),
            on_message=Inbox(),
            fds=(devnull, pipe.write_fd, pipe.write_fd),
        )
    )
    await handler.commands.put(Assign(GPU, LIMITS))
    assert await pipe.line() == "still serving"
    async with asyncio.timeout(TIMEOUT):
        assert await client == 0


async def test_silent_client_is_timed_out(socket_path: Path) -> None:
    async with WorkloadSocketServer(socket_path, FakeHandler(), request_timeout_seconds=0.2):
        rejected = decode_executor_message(await raw_exchange(socket_path, b'{"type": "RunRe'))
    assert rejected == Rejected(reason="request-timeout", message="no complete request in time")


async def test_oversized_request_is_rejected(socket_path: Path) -> None:
    async with WorkloadSocketServer(socket_path, FakeHandler()):
        reply = await raw_exchange(socket_path, b"x" * (2 * 1024 * 1024))
    rejected = decode_executor_message(reply)
    assert isinstance(rejected, Rejected)
    assert rejected.reason == "request-too-large"


async def test_failing_handler_answers_internal_error(
    socket_path: Path, pipe: Pipe, devnull: int
) -> None:
    inbox = Inbox()
    async with WorkloadSocketServer(socket_path, BrokenHandler()):
        code = await run_workload(
            socket_path,
            request_for(["true"]),
            on_message=inbox,
            fds=(devnull, pipe.write_fd, pipe.write_fd),
        )
    assert code == 2
    assert inbox.messages == [Rejected(reason="internal-error", message="the glue fell over")]


async def test_no_executor_means_unavailable(tmp_path: Path, devnull: int) -> None:
    with pytest.raises(ExecutorUnavailable):
        await run_workload(
            tmp_path / "absent.sock",
            request_for(["true"]),
            on_message=Inbox(),
            fds=(devnull, devnull, devnull),
        )
    assert EXIT_EXECUTOR_UNAVAILABLE == 69


async def test_socket_file_mode_and_stale_socket(socket_path: Path) -> None:
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(socket_path))
    stale.close()  # a socket file left by a crashed executor
    async with WorkloadSocketServer(socket_path, FakeHandler()):
        assert stat.S_IMODE(os.stat(socket_path).st_mode) == 0o660
    assert not _exists(socket_path)


def _exists(path: Path) -> bool:
    return path.exists()


def test_refuses_to_replace_a_regular_file(socket_path: Path) -> None:
    socket_path.write_text("important")
    with pytest.raises(FileExistsError):
        asyncio.run(WorkloadSocketServer(socket_path, FakeHandler()).start())
    assert socket_path.read_text() == "important"
