"""ProcessSupervisor against real processes: process groups, sessions, signals, exit codes."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from gpupool.events import PodRef
from gpupool.gpus import GpuSample
from gpupool.node_executor.memory_guard import GuardedWorkload, MemoryOverrun, guard_memory
from gpupool.node_executor.processes import (
    ProcessSupervisor,
    Workload,
    WorkloadStartFailed,
    group_members,
    leader_exited,
    shell_exit_code,
)

pytestmark = pytest.mark.integration

POD = PodRef(namespace="default", name="demo")
READY_TIMEOUT = 10.0


class Pipe:
    """The workload's stdout, read by the test line by line."""

    def __init__(self, reader: asyncio.StreamReader, write_fd: int) -> None:
        self.reader = reader
        self.write_fd = write_fd

    async def line(self) -> str:
        async with asyncio.timeout(READY_TIMEOUT):
            return (await self.reader.readline()).decode().rstrip("\n")


@pytest.fixture
async def stdout_pipe() -> AsyncIterator[Pipe]:
    read_fd, write_fd = os.pipe()
    reader = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(read_fd, "rb", buffering=0)
    )
    pipe = Pipe(reader, write_fd)
    yield pipe
    transport.close()
    if pipe.write_fd >= 0:
        os.close(pipe.write_fd)


@pytest.fixture
def devnull() -> Iterator[int]:
    fd = os.open(os.devnull, os.O_RDONLY)
    yield fd
    os.close(fd)


async def start_python(
    supervisor: ProcessSupervisor, code: str, pipe: Pipe, devnull: int, **env: str
) -> Workload:
    workload = await supervisor.start(
        POD,
        [sys.executable, "-c", code],
        {"PATH": os.environ["PATH"], **env},
        str(Path.cwd()),
        (devnull, pipe.write_fd, pipe.write_fd),
    )
    # The child holds its own copy; close ours so EOF means "every writer is gone".
    os.close(pipe.write_fd)
    pipe.write_fd = -1
    return workload


def alive(pid: int) -> bool:
    """Present and not a zombie (an orphan's zombie is reaped by init, not by us)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


STUBBORN_WITH_GRANDCHILD = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = os.fork()
if child == 0:
    while True:
        signal.pause()
print("ready", os.getpid(), child, flush=True)
while True:
    signal.pause()
"""


async def test_sigterm_ignoring_workload_and_its_grandchild_are_killed(
    stdout_pipe: Pipe, devnull: int
) -> None:
    supervisor = ProcessSupervisor()
    workload = await start_python(supervisor, STUBBORN_WITH_GRANDCHILD, stdout_pipe, devnull)
    _, leader, grandchild = (await stdout_pipe.line()).split()
    assert int(leader) == workload.pid
    assert group_members(int(leader)) == sorted([int(leader), int(grandchild)])

    termination = await supervisor.terminate(workload, grace_seconds=0.3)

    assert termination.ended_by == "SIGKILL"
    assert termination.exit_code == 128 + signal.SIGKILL
    assert termination.confirmed
    assert not alive(int(leader))
    assert not alive(int(grandchild))
    assert group_members(int(leader)) == []


async def test_workload_that_obeys_sigterm_needs_no_sigkill(
    stdout_pipe: Pipe, devnull: int
) -> None:
    supervisor = ProcessSupervisor()
    code = "import os, signal; print('ready', flush=True); signal.pause()"
    workload = await start_python(supervisor, code, stdout_pipe, devnull)
    assert await stdout_pipe.line() == "ready"

    termination = await supervisor.terminate(workload, grace_seconds=30)

    assert termination.ended_by == "SIGTERM"
    assert termination.exit_code == 128 + signal.SIGTERM


ESCAPES_TO_OWN_GROUP = """
import os, signal
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = os.fork()
if child == 0:
    os.setpgid(0, 0)   # its own process group, still in the workload's session
    while True:
        signal.pause()
os.setpgid(child, child)   # both sides, as shells do, so the answer below is settled
print("ready", child, os.getpgid(child), flush=True)
while True:
    signal.pause()
"""


async def test_child_in_another_process_group_of_the_session_is_killed_too(
    stdout_pipe: Pipe, devnull: int
) -> None:
    supervisor = ProcessSupervisor()
    workload = await start_python(supervisor, ESCAPES_TO_OWN_GROUP, stdout_pipe, devnull)
    _, child, child_group = (await stdout_pipe.line()).split()
    assert child_group == child  # it really left the workload's process group

    termination = await supervisor.terminate(workload, grace_seconds=0.2)

    assert termination.confirmed
    assert not alive(int(child))


async def test_leftover_background_process_is_ended_after_the_leader_exits(
    stdout_pipe: Pipe, devnull: int
) -> None:
    supervisor = ProcessSupervisor()
    code = (
        "import os, signal\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    signal.pause()\n"
        "print('ready', child, flush=True)\n"
    )
    workload = await start_python(supervisor, code, stdout_pipe, devnull)
    _, child = (await stdout_pipe.line()).split()
    assert await supervisor.wait(workload) == 0
    assert alive(int(child))

    termination = await supervisor.terminate(workload, grace_seconds=10)

    assert termination.ended_by == "SIGTERM"
    assert termination.exit_code == 0  # the leader's own
    assert not alive(int(child))


async def test_terminating_a_finished_workload_reports_it_exited(
    stdout_pipe: Pipe, devnull: int
) -> None:
    supervisor = ProcessSupervisor()
    workload = await start_python(supervisor, "raise SystemExit(4)", stdout_pipe, devnull)
    assert await supervisor.wait(workload) == 4

    termination = await supervisor.terminate(workload, grace_seconds=10)

    assert termination.ended_by == "exited"
    assert termination.exit_code == 4


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        pytest.param("pass", 0, id="success"),
        pytest.param("raise SystemExit(3)", 3, id="exit-3"),
        pytest.param("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", 137, id="sigkill"),
        pytest.param("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", 139, id="sigsegv"),
    ],
)
async def test_exit_codes_in_shell_form(
    stdout_pipe: Pipe, devnull: int, code: str, expected: int
) -> None:
    supervisor = ProcessSupervisor()
    workload = await start_python(supervisor, code, stdout_pipe, devnull)
    assert await supervisor.wait(workload) == expected


def unreaped(pid: int) -> bool:
    """Still our child (running or a zombie): ``waitid`` without reaping it finds it."""
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


async def test_a_workload_is_reaped_once_and_every_waiter_gets_its_exit_code(
    stdout_pipe: Pipe, devnull: int
) -> None:
    supervisor = ProcessSupervisor()
    code = "import sys; print('ready', flush=True); sys.stdin.read(); raise SystemExit(5)"
    read_fd, write_fd = os.pipe()
    try:
        workload = await supervisor.start(
            POD,
            [sys.executable, "-c", code],
            {"PATH": os.environ["PATH"]},
            "/",
            (read_fd, stdout_pipe.write_fd, devnull),
        )
    finally:
        os.close(read_fd)
    os.close(stdout_pipe.write_fd)
    stdout_pipe.write_fd = -1
    waiters = [asyncio.create_task(supervisor.wait(workload)) for _ in range(3)]
    cancelled = asyncio.create_task(supervisor.wait(workload))
    assert await stdout_pipe.line() == "ready"  # meanwhile every waiter has begun waiting
    assert unreaped(workload.pid)
    cancelled.cancel()
    os.close(write_fd)  # EOF: it exits 5

    async with asyncio.timeout(READY_TIMEOUT):
        assert await asyncio.gather(*waiters) == [5, 5, 5]
    assert cancelled.cancelled()
    assert not unreaped(workload.pid)  # reaped: no zombie left
    assert await supervisor.wait(workload) == 5


async def test_a_workload_is_waited_for_through_sigchld_where_pidfds_are_unavailable(
    stdout_pipe: Pipe, devnull: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_pidfds(pid: int, flags: int = 0) -> int:
        raise OSError(errno.ENOSYS, "pidfd_open: not implemented (Linux < 5.3)")

    supervisor = ProcessSupervisor()
    with monkeypatch.context() as patch:
        patch.setattr(os, "pidfd_open", no_pidfds)
        first = await start_python(supervisor, "raise SystemExit(6)", stdout_pipe, devnull)
        second = await supervisor.start(
            POD, [sys.executable, "-c", "raise SystemExit(7)"], {}, "/", (devnull, devnull, devnull)
        )
    async with asyncio.timeout(READY_TIMEOUT):
        assert await supervisor.wait(first) == 6
        assert await supervisor.wait(second) == 7
    assert not unreaped(first.pid) and not unreaped(second.pid)
    # the last one reaped takes the SIGCHLD handler away again
    assert signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL


async def test_workload_gets_exactly_its_env_cwd_and_stdio(
    stdout_pipe: Pipe, devnull: int, tmp_path: Path
) -> None:
    supervisor = ProcessSupervisor()
    code = (
        "import os, sys\n"
        "print(os.getcwd(), os.environ.get('GPUPOOL_POD'), 'HOME' in os.environ, flush=True)\n"
        "print('to-stderr', file=sys.stderr, flush=True)\n"
        "print(os.getpgid(0) == os.getpid() == os.getsid(0), flush=True)\n"
    )
    workload = await supervisor.start(
        POD,
        [sys.executable, "-c", code],
        {"GPUPOOL_POD": "default/demo"},
        str(tmp_path),
        (devnull, stdout_pipe.write_fd, stdout_pipe.write_fd),
    )
    os.close(stdout_pipe.write_fd)
    stdout_pipe.write_fd = -1
    assert await stdout_pipe.line() == f"{tmp_path} default/demo False"
    assert await stdout_pipe.line() == "to-stderr"
    assert await stdout_pipe.line() == "True"  # leads its own session and process group
    assert await supervisor.wait(workload) == 0


async def test_argv_is_not_given_to_a_shell(stdout_pipe: Pipe, devnull: int) -> None:
    supervisor = ProcessSupervisor()
    code = "import sys; print(sys.argv[1:], flush=True)"
    workload = await supervisor.start(
        POD,
        [sys.executable, "-c", code, "$HOME", "a b", ";", "echo hi"],
        {},
        "/",
        (devnull, stdout_pipe.write_fd, stdout_pipe.write_fd),
    )
    os.close(stdout_pipe.write_fd)
    stdout_pipe.write_fd = -1
    assert await stdout_pipe.line() == "['$HOME', 'a b', ';', 'echo hi']"
    assert await supervisor.wait(workload) == 0


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        pytest.param(["/nonexistent/gpupool-test-command"], 127, id="not-found"),
        pytest.param(["/etc/hostname"], 126, id="not-executable"),
        pytest.param([], 126, id="empty"),
    ],
)
async def test_commands_that_cannot_start(devnull: int, argv: list[str], expected: int) -> None:
    with pytest.raises(WorkloadStartFailed) as failure:
        await ProcessSupervisor().start(POD, argv, {}, "/", (devnull, devnull, devnull))
    assert failure.value.exit_code == expected


@pytest.mark.parametrize(("returncode", "expected"), [(0, 0), (1, 1), (-9, 137), (-15, 143)])
def test_shell_exit_code(returncode: int, expected: int) -> None:
    assert shell_exit_code(returncode) == expected


@pytest.mark.skipif(os.geteuid() != 0, reason="changing user needs root, as the executor has")
async def test_workload_runs_as_the_peers_user_without_extra_groups(
    stdout_pipe: Pipe, devnull: int
) -> None:
    supervisor = ProcessSupervisor()
    id_command = shutil.which("id")
    assert id_command is not None
    workload = await supervisor.start(
        POD,
        [id_command],
        {},
        "/",
        (devnull, stdout_pipe.write_fd, stdout_pipe.write_fd),
        run_as=(65534, 65534),
    )
    os.close(stdout_pipe.write_fd)
    stdout_pipe.write_fd = -1
    uid, gid, groups = (await stdout_pipe.line()).split()
    assert uid.startswith("uid=65534(")
    assert gid.startswith("gid=65534(")
    assert groups.startswith("groups=65534(")
    assert "," not in groups  # root's supplementary groups were dropped
    assert await supervisor.wait(workload) == 0


class NamingSampler:
    """A real-GPU sampler whose one card shows the given pids, each holding 1 MiB."""

    source = "nvml"

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids

    def sample(self) -> tuple[GpuSample, ...]:
        return (
            GpuSample(
                index=0,
                uuid="GPU-0",
                memory_used_bytes=len(self.pids) << 20,
                memory_total_bytes=1 << 30,
                utilisation=0.5,
                process_memory_bytes={pid: 1 << 20 for pid in self.pids},
            ),
        )


def test_a_forked_member_holding_gpu_memory_is_counted_without_scanning_proc(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The memory guard attributes a sampled pid to a workload by that pid's own group and
    session (one stat read), not by listing every process: a child forked into its own
    process group but still in the session is the workload's; an outsider is not. Driven
    through ``guard_memory`` itself, with any listing of ``/proc`` failing the test."""
    script = (
        "import os, sys, time\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os.setpgid(0, 0)\n"
        "    time.sleep(60)\n"
        "print(pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    leader = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, start_new_session=True
    )
    outsider = subprocess.Popen(["sleep", "60"], start_new_session=True)
    child = 0
    try:
        assert leader.stdout is not None
        child = int(leader.stdout.readline())
        pod = PodRef(namespace="default", name="guarded")
        workload = GuardedWorkload(
            pod=pod,
            gpu_uuid="GPU-0",
            memory_limit_bytes=1 << 20,  # the leader's own MiB fits; with its child's it does not
            pids=frozenset({leader.pid}),
            leader=leader.pid,
        )
        overruns: list[MemoryOverrun] = []

        async def one_guard_round() -> None:
            stop = asyncio.Event()

            async def on_overrun(overrun: MemoryOverrun) -> None:
                overruns.append(overrun)
                stop.set()

            async with asyncio.timeout(30):
                await guard_memory(
                    NamingSampler([leader.pid, child, outsider.pid]),
                    lambda: [workload],
                    on_overrun,
                    period_seconds=0.05,
                    stop=stop,
                )

        def no_scan(path: object = ".") -> list[str]:
            if str(path).rstrip("/") == "/proc":
                raise AssertionError("the memory guard listed every process")
            return real_listdir(path)  # type: ignore[arg-type]

        real_listdir = os.listdir
        monkeypatch.setattr(os, "listdir", no_scan)
        asyncio.run(one_guard_round())
        monkeypatch.undo()
        (overrun,) = overruns
        assert overrun.pod == pod
        assert set(overrun.pids) == {leader.pid, child}  # not the outsider
        assert overrun.used_bytes == 2 << 20
        assert not leader_exited(leader.pid)
    finally:
        if child:
            os.kill(child, signal.SIGKILL)
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()
        outsider.kill()
        outsider.wait()
    assert leader_exited(leader.pid)
