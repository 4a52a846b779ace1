"""A command started for a caller never has more privilege than the caller had (issue 12).

The executor runs as root with every capability (here: this test process); in kernel mode a
uid-0 caller's command used to run with the executor's capabilities (SYS_ADMIN, SYS_PTRACE…).
Real processes: a caller started under ``setpriv`` with a cut bounding set (or as another
user with its own groups), and the command itself, which prints its own /proc/self/status.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from gpupool.events import PodRef
from gpupool.node_executor.processes import CallerCredentials, ProcessSupervisor, credentials_of

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("setpriv") is None,
        reason="needs root (as the executor) and util-linux setpriv",
    ),
]

POD = PodRef(namespace="default", name="p")
CAP_SYS_PTRACE = 19
CAP_SYS_ADMIN = 21
CAP_CHOWN, CAP_KILL, CAP_SETGID, CAP_SETUID = 0, 5, 6, 7


def status_fields(text: str) -> dict[str, str]:
    return {
        name: value.strip()
        for name, _, value in (line.partition(":") for line in text.splitlines())
    }


READY_THEN_SLEEP = ("sh", "-c", "echo ready; exec sleep 60")
"""The caller says when setpriv has made it what it is (then it is ``sleep``, same pid)."""


async def ready(caller: asyncio.subprocess.Process) -> None:
    assert caller.stdout is not None
    async with asyncio.timeout(15):
        assert await caller.stdout.readline() == b"ready\n"


@pytest.fixture
def devnull() -> Iterator[int]:
    fd = os.open(os.devnull, os.O_RDWR)
    yield fd
    os.close(fd)


@pytest.fixture
async def caller_with_few_capabilities() -> AsyncIterator[int]:
    """A uid-0 caller whose bounding set holds only CHOWN, KILL, SETGID and SETUID."""
    caller = await asyncio.create_subprocess_exec(
        "setpriv",
        "--bounding-set=-all,+chown,+kill,+setgid,+setuid",
        "--inh-caps=-all",
        "--",
        *READY_THEN_SLEEP,
        stdout=asyncio.subprocess.PIPE,
    )
    await ready(caller)
    yield caller.pid
    caller.kill()
    await caller.wait()


@pytest.fixture
async def caller_as_a_user() -> AsyncIterator[int]:
    caller = await asyncio.create_subprocess_exec(
        "setpriv",
        "--reuid=4242",
        "--regid=4242",
        "--groups=4242,27",
        "--",
        *READY_THEN_SLEEP,
        stdout=asyncio.subprocess.PIPE,
    )
    await ready(caller)
    yield caller.pid
    caller.kill()
    await caller.wait()


async def own_status(
    tmp_path: Path, devnull: int, caller: int, *, in_its_namespaces: bool
) -> dict[str, str]:
    """Start ``cat /proc/self/status`` for ``caller`` as the executor does; what it printed."""
    out = tmp_path / "status.txt"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        supervisor = ProcessSupervisor(records_dir=tmp_path / "workloads")
        status = Path(f"/proc/{caller}/status").read_text()
        uid = int(status_fields(status)["Uid"].split()[0])
        gid = int(status_fields(status)["Gid"].split()[0])
        workload = await supervisor.start(
            POD,
            ["cat", "/proc/self/status"],
            {"PATH": os.environ["PATH"]},
            "/",
            (devnull, fd, fd),
            run_as=(uid, gid),
            namespaces_of=caller if in_its_namespaces else None,
            credentials=credentials_of(caller, uid, gid),
        )
        async with asyncio.timeout(15):
            assert await supervisor.wait(workload) == 0
    finally:
        os.close(fd)
    return status_fields(out.read_text())


@pytest.mark.parametrize("in_its_namespaces", [True, False], ids=["kernel-mode", "local-mode"])
async def test_a_root_callers_command_keeps_no_capability_the_caller_lacks(
    tmp_path: Path, devnull: int, caller_with_few_capabilities: int, in_its_namespaces: bool
) -> None:
    caller = status_fields(Path(f"/proc/{caller_with_few_capabilities}/status").read_text())
    mine = status_fields(Path("/proc/self/status").read_text())
    assert int(mine["CapEff"], 16) >> CAP_SYS_ADMIN & 1  # the executor has it to give away
    command = await own_status(
        tmp_path, devnull, caller_with_few_capabilities, in_its_namespaces=in_its_namespaces
    )
    allowed = int(caller["CapBnd"], 16)
    assert allowed == sum(1 << c for c in (CAP_CHOWN, CAP_KILL, CAP_SETGID, CAP_SETUID))
    assert command["Uid"].split()[0] == "0"
    assert int(command["CapBnd"], 16) == allowed
    assert int(command["CapEff"], 16) & ~allowed == 0
    assert not int(command["CapEff"], 16) >> CAP_SYS_ADMIN & 1
    assert not int(command["CapEff"], 16) >> CAP_SYS_PTRACE & 1
    assert command["NoNewPrivs"] == "1"


@pytest.mark.parametrize("in_its_namespaces", [True, False], ids=["kernel-mode", "local-mode"])
async def test_a_users_command_runs_as_that_user_with_its_groups_and_no_capabilities(
    tmp_path: Path, devnull: int, caller_as_a_user: int, in_its_namespaces: bool
) -> None:
    command = await own_status(
        tmp_path, devnull, caller_as_a_user, in_its_namespaces=in_its_namespaces
    )
    assert command["Uid"].split() == ["4242"] * 4
    assert command["Gid"].split() == ["4242"] * 4
    assert command["Groups"].split() == ["27", "4242"]
    assert int(command["CapEff"], 16) == 0
    assert int(command["CapPrm"], 16) == 0
    assert command["NoNewPrivs"] == "1"


async def start_for_user(
    tmp_path: Path, devnull: int, argv: list[str], path: str, *, credentials: bool
) -> tuple[int, str]:
    """Start ``argv`` for uid/gid 4242 as a root executor does (with or without the caller's
    credentials read from /proc: ``run_as`` alone); its exit code and what it wrote."""
    out = tmp_path / "out.txt"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        supervisor = ProcessSupervisor(records_dir=tmp_path / "workloads")
        workload = await supervisor.start(
            POD,
            argv,
            {"PATH": path},
            "/",
            (devnull, fd, fd),
            run_as=(4242, 4242),
            credentials=CallerCredentials(uid=4242, gid=4242) if credentials else None,
        )
        async with asyncio.timeout(15):
            code = await supervisor.wait(workload)
    finally:
        os.close(fd)
    return code, out.read_text()


async def test_a_users_command_starts_though_the_executors_interpreter_is_out_of_its_reach(
    tmp_path: Path, devnull: int
) -> None:
    """The shim (the executor's own Python) runs as the executor and drops to the caller for
    the command only: a venv under /root, unreadable by the caller, starts commands for it."""
    code, out = await start_for_user(
        tmp_path, devnull, ["id", "-u"], os.environ["PATH"], credentials=False
    )
    assert (code, out) == (0, "4242\n")


async def test_a_command_the_caller_cannot_reach_is_refused_naming_the_directory(
    tmp_path: Path, devnull: int
) -> None:
    # under a directory everyone may search (pytest's own temporary root is root's, 0700)
    reachable = Path(tempfile.mkdtemp(prefix="gpupool-reach-"))
    try:
        reachable.chmod(0o755)
        await refused_naming_the_directory(reachable, tmp_path, devnull)
    finally:
        shutil.rmtree(reachable)


async def refused_naming_the_directory(base: Path, tmp_path: Path, devnull: int) -> None:
    private = base / "private"
    (private / "bin").mkdir(parents=True)
    tool = private / "bin" / "tool"
    tool.write_text("#!/bin/sh\necho ran\n")
    tool.chmod(0o755)
    private.chmod(0o700)  # root's own, as /root is
    link = base / "bin"
    link.mkdir()
    (link / "tool").symlink_to(tool)
    link.chmod(0o755)
    for with_credentials in (True, False):
        code, out = await start_for_user(
            tmp_path, devnull, ["tool"], f"{link}:/usr/bin:/bin", credentials=with_credentials
        )
        assert code == 126
        assert f"{link / 'tool'} is {tool}, and uid 4242 may not search {private}" in out, out
        assert "ran" not in out
