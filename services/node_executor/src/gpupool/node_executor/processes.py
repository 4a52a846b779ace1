"""Starting workloads as process groups and ending them, grandchildren included.

A workload is started with ``start_new_session=True``: it leads a new session and process
group whose id is its pid. Ending it sends SIGTERM to the group, SIGKILL after the grace
period if anything of it is still alive, and then *confirms* it is gone by scanning ``/proc``
for any process still in the group or the session (so a child that moved to its own process
group is found too). Waiting is done on pidfds, never by sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Mapping, Sequence
from typing import Literal

import msgspec

from gpupool.events import PodRef
from gpupool.workload import StdioFds

DEFAULT_KILL_CONFIRM_SECONDS = 5.0
"""How long to wait, after SIGKILL, for the kernel to finish the processes off."""


class WorkloadStartFailed(RuntimeError):
    """The command could not be started; ``exit_code`` follows the shell (127 not found, 126 other)."""

    def __init__(self, argv: Sequence[str], error: OSError | ValueError) -> None:
        super().__init__(f"cannot start {list(argv)!r}: {error}")
        self.exit_code = 127 if isinstance(error, FileNotFoundError) else 126


class Workload:
    """A started command: the leader of its own session and process group (``pid`` == pgid == sid)."""

    def __init__(self, pod: PodRef, process: asyncio.subprocess.Process) -> None:
        self.pod = pod
        self.process = process
        self.pid = process.pid

    def __repr__(self) -> str:
        return f"Workload(pod={self.pod.key!r}, pid={self.pid})"


EndedBy = Literal["exited", "SIGTERM", "SIGKILL"]


class Termination(msgspec.Struct, frozen=True, kw_only=True):
    """How a workload was ended.

    ``ended_by`` is ``exited`` when nothing of it was running any more, ``SIGTERM`` when it went
    within the grace period, ``SIGKILL`` otherwise. ``survivors`` lists pids still present after
    SIGKILL and the confirmation wait (stuck in the kernel); empty means confirmed gone.
    """

    ended_by: EndedBy
    exit_code: int
    survivors: tuple[int, ...] = ()

    @property
    def confirmed(self) -> bool:
        return not self.survivors


def shell_exit_code(returncode: int) -> int:
    """asyncio's returncode (negative for a signal) in the shell's form (128 + signal)."""
    return 128 - returncode if returncode < 0 else returncode


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` from the state field on (the command name may hold spaces)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read().decode(errors="replace")
    except OSError:
        return None
    return text.rpartition(")")[2].split()


def _in_group(fields: list[str], leader: int) -> bool:
    state, _ppid, pgrp, session = fields[0], fields[1], int(fields[2]), int(fields[3])
    return state not in ("Z", "X") and leader in (pgrp, session)


def group_members(leader: int) -> list[int]:
    """Live (non-zombie) processes whose process group or session is ``leader``'s."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields is not None and _in_group(fields, leader):
                members.append(int(entry))
    return sorted(members)


def _open_member(pid: int, leader: int) -> int | None:
    """A pidfd for ``pid`` if it is (still) a live member; checked after opening, against pid reuse."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return None
    fields = _stat_fields(pid)
    if fields is None or not _in_group(fields, leader):
        os.close(pidfd)
        return None
    return pidfd


async def _exited(pidfd: int) -> None:
    """A pidfd becomes readable when its process has exited."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not done.done():
            done.set_result(None)

    loop.add_reader(pidfd, wake)
    try:
        await done
    finally:
        loop.remove_reader(pidfd)


def _signal_group(leader: int, signum: signal.Signals) -> None:
    """killpg (atomic for the group, so a fork in flight is caught) plus session members elsewhere."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(leader, signum)
    for pid in group_members(leader):
        pidfd = _open_member(pid, leader)
        if pidfd is None:
            continue
        try:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pidfd, signum)
        finally:
            os.close(pidfd)


async def wait_group_gone(leader: int, within_seconds: float) -> list[int]:
    """Wait until no live process is in ``leader``'s group or session; returns the survivors."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_seconds
    while True:
        pidfds = [
            fd for pid in group_members(leader) if (fd := _open_member(pid, leader)) is not None
        ]
        if not pidfds:
            return []
        try:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return group_members(leader)
            try:
                async with asyncio.timeout(remaining):
                    await asyncio.gather(*(_exited(fd) for fd in pidfds))
            except TimeoutError:
                return group_members(leader)
        finally:
            for fd in pidfds:
                os.close(fd)


class ProcessSupervisor:
    """Starts, waits for and ends workloads. One per node-executor."""

    def __init__(self, *, kill_confirm_seconds: float = DEFAULT_KILL_CONFIRM_SECONDS) -> None:
        self._kill_confirm_seconds = kill_confirm_seconds

    async def start(
        self,
        pod: PodRef,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: str,
        fds: StdioFds,
        *,
        run_as: tuple[int, int] | None = None,
    ) -> Workload:
        """Run ``argv`` (no shell) in a new session with ``fds`` as stdin/stdout/stderr.

        ``run_as`` is (uid, gid): the workload runs as that user with no supplementary groups
        (the executor passes the connecting peer's credentials, so no one gains privileges).
        """
        identity: dict[str, object] = {}
        if run_as is not None and run_as != (os.getuid(), os.getgid()):
            identity = {"user": run_as[0], "group": run_as[1], "extra_groups": []}
        try:
            if not argv:
                raise ValueError("empty command")
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=fds[0],
                stdout=fds[1],
                stderr=fds[2],
                env=dict(env),
                cwd=cwd,
                start_new_session=True,
                **identity,  # type: ignore[arg-type]
            )
        except (OSError, ValueError) as error:
            raise WorkloadStartFailed(argv, error) from error
        return Workload(pod, process)

    async def wait(self, workload: Workload) -> int:
        """The leader's exit code once it exits (128 + signal when a signal ended it)."""
        return shell_exit_code(await workload.process.wait())

    async def terminate(self, workload: Workload, grace_seconds: float) -> Termination:
        """SIGTERM the group, SIGKILL what is left after ``grace_seconds``, confirm it is gone."""
        leader = workload.pid
        if not group_members(leader):
            return Termination(ended_by="exited", exit_code=await self.wait(workload))
        _signal_group(leader, signal.SIGTERM)
        ended_by: EndedBy = "SIGTERM"
        survivors = await wait_group_gone(leader, grace_seconds)
        if survivors:
            ended_by = "SIGKILL"
            _signal_group(leader, signal.SIGKILL)
            survivors = await wait_group_gone(leader, self._kill_confirm_seconds)
        exit_code = await self.wait(workload)
        return Termination(ended_by=ended_by, exit_code=exit_code, survivors=tuple(survivors))
