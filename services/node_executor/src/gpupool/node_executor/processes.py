"""Starting workloads as process groups and ending them, grandchildren included.

With a records directory, a workload is started through the shim
(:mod:`gpupool.node_executor.shim`) and recorded on disk (pod, pid, start time,
status file): a node-executor that crashed and restarted *adopts* the workloads
of its predecessor — it waits for them through pidfds and reads their exit status
from the shim's status file — so a running job survives an executor crash.

A workload is started with ``start_new_session=True``: it leads a new session and process
group whose id is its pid. Ending it sends SIGTERM to the group, SIGKILL after the grace
period if anything of it is still alive, and then *confirms* it is gone by scanning ``/proc``
for any process still in the group or the session (so a child that moved to its own process
group is found too). Waiting is done on pidfds, never by sleeping.

A started workload's leader is not owned by an asyncio subprocess transport: one left running
when the event loop closes (the service failed) is killed by the transport's ``close()`` on
Python 3.12+, where no child-watcher thread keeps it alive — the shim would die with the
executor and the command run on untracked. It is started with :class:`subprocess.Popen` (as
asyncio would) and waited for by :class:`Child`: a pidfd in the event loop, one
``waitpid`` when it becomes readable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Literal

import msgspec

from gpupool.events import PodRef
from gpupool.workload import StdioFds

log = logging.getLogger(__name__)

DEFAULT_KILL_CONFIRM_SECONDS = 5.0
"""How long to wait, after SIGKILL, for the kernel to finish the processes off."""


SHIM = ("-I", "-S", str(Path(__file__).with_name("shim.py")))
"""The shim runs isolated and without site-packages (it needs only the standard library,
and finds its own modules beside ``shim.py``): a start costs the bare interpreter's CPU and
a few milliseconds more (docs/benchmarks.md, "The workload shim's start")."""


class CallerCredentials(msgspec.Struct, frozen=True, kw_only=True):
    """The caller's uid, gid, groups and capability masks (``/proc/<pid>/status``, at connect).

    A command started for the caller gets no more than these: ``no_new_privs``, the bounding
    set cut to ``cap_bnd``, the caller's groups, gid and uid (see the shim).
    """

    uid: int
    gid: int
    groups: tuple[int, ...] = ()
    cap_bnd: int = 0
    cap_eff: int = 0
    cap_prm: int = 0
    cap_inh: int = 0

    def shim_options(self) -> list[str]:
        groups = ",".join(str(g) for g in self.groups)
        masks = ":".join(f"{m:x}" for m in (self.cap_bnd, self.cap_eff, self.cap_prm, self.cap_inh))
        return ["--as", f"{self.uid}:{self.gid}:{groups}", "--caps", masks]


def credentials_of(pid: int, uid: int, gid: int) -> CallerCredentials:
    """The credentials of process ``pid`` (uid/gid as ``SO_PEERCRED`` gave them); a process
    whose status cannot be read keeps its uid/gid and gets no groups and no capabilities."""
    fields: dict[str, str] = {}
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                name, _, value = line.partition(":")
                fields[name] = value.strip()
    except OSError:
        return CallerCredentials(uid=uid, gid=gid)

    def mask(name: str) -> int:
        try:
            return int(fields.get(name, "0"), 16)
        except ValueError:
            return 0

    groups = tuple(int(g) for g in fields.get("Groups", "").split() if g.isdigit())
    return CallerCredentials(
        uid=uid,
        gid=gid,
        groups=groups,
        cap_bnd=mask("CapBnd"),
        cap_eff=mask("CapEff"),
        cap_prm=mask("CapPrm"),
        cap_inh=mask("CapInh"),
    )


class WorkloadStartFailed(RuntimeError):
    """The command could not be started; ``exit_code`` follows the shell (127 not found, 126 other)."""

    def __init__(self, argv: Sequence[str], error: OSError | ValueError) -> None:
        super().__init__(f"cannot start {list(argv)!r}: {error}")
        self.exit_code = 127 if isinstance(error, FileNotFoundError) else 126


class _Unowned(subprocess.Popen[bytes]):
    """A Popen that leaves its child to :class:`Child`: dropped as soon as the child is
    started, it neither warns that the child still runs nor queues it for ``subprocess``'s
    own reaping (which would take its exit status from :class:`Child`)."""

    def __del__(self) -> None:
        pass


_WITHOUT_PIDFD: dict[asyncio.AbstractEventLoop, set[Child]] = {}
"""Children waited for by SIGCHLD, per loop, where pidfds are unavailable (Linux before 5.3)."""


class Child:
    """A workload's leader started by this executor, waited for without asyncio's child watcher.

    Its exit is noticed through a pidfd in the event loop (or, without pidfds, a SIGCHLD
    handler that polls only this executor's children) and it is reaped exactly once, with one
    ``waitpid``: no thread per child, no zombie, nothing that ends it when the loop closes.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._loop = asyncio.get_running_loop()
        self._exited: asyncio.Future[int] = self._loop.create_future()
        self._pidfd: int | None = None
        try:
            self._pidfd = os.pidfd_open(pid)
        except OSError:  # no pidfd_open (ENOSYS): SIGCHLD tells when to look
            children = _WITHOUT_PIDFD.setdefault(self._loop, set())
            if not children:
                self._loop.add_signal_handler(signal.SIGCHLD, _reap_without_pidfd, self._loop)
            children.add(self)
        else:
            self._loop.add_reader(self._pidfd, self._reap)
        self._reap()  # it may have exited already (and its SIGCHLD been and gone)

    def _reap(self) -> None:
        if self._exited.done():
            return
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # reaped elsewhere (nothing here does): its status is lost
            log.warning("node-executor: child %d was reaped elsewhere; exit status 255", self.pid)
            code = 255
        else:
            if pid == 0:
                return  # still running
            code = shell_exit_code(os.waitstatus_to_exitcode(status))
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        else:
            children = _WITHOUT_PIDFD.get(self._loop, set())
            children.discard(self)
            if not children:
                _WITHOUT_PIDFD.pop(self._loop, None)
                self._loop.remove_signal_handler(signal.SIGCHLD)
        self._exited.set_result(code)

    async def wait(self) -> int:
        """Its exit code in the shell's form; any number of waiters, each may be cancelled."""
        return await asyncio.shield(self._exited)


def _reap_without_pidfd(loop: asyncio.AbstractEventLoop) -> None:
    for child in list(_WITHOUT_PIDFD.get(loop, ())):
        child._reap()


class Workload:
    """A started command: the leader of its own session and process group (``pid`` == pgid == sid).

    ``child`` is set when this executor started it; an adopted workload (started by an
    executor that crashed) has only its pid and the shim's status file.
    """

    def __init__(
        self,
        pod: PodRef,
        pid: int,
        *,
        child: Child | None = None,
        status_file: Path | None = None,
        record: Path | None = None,
    ) -> None:
        self.pod = pod
        self.pid = pid
        self.child = child
        self.status_file = status_file
        self.record = record
        self._exit_code: int | None = None

    @property
    def adopted(self) -> bool:
        return self.child is None

    async def wait_exit(self) -> int:
        """The exit code in the shell's form, once the leader has exited."""
        if self._exit_code is None:
            if self.child is not None:
                self._exit_code = await self.child.wait()
            else:
                self._exit_code = await _wait_adopted(self.pid, self.status_file)
        return self._exit_code

    def forget(self) -> None:
        """Remove its record and status file once its end has been recorded."""
        for path in (self.record, self.status_file):
            if path is not None:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

    def __repr__(self) -> str:
        return f"Workload(pod={self.pod.key!r}, pid={self.pid}, adopted={self.adopted})"


class WorkloadRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What survives an executor crash: enough to find the workload again and read its end."""

    pod: PodRef
    pid: int
    start_ticks: int
    """Field 22 of /proc/<pid>/stat: tells the shim from a later process that reused its pid."""
    status_file: str


def process_start_ticks(pid: int) -> int | None:
    fields = _stat_fields(pid)
    if fields is None or len(fields) < 20:
        return None
    return int(fields[19])


def read_status(status_file: Path | None) -> int | None:
    if status_file is None:
        return None
    try:
        return int(status_file.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


async def _wait_adopted(pid: int, status_file: Path | None) -> int:
    """Wait for a process that is not our child, then read the status the shim wrote.

    No status means the shim itself was killed before it could write one, which only
    SIGKILL does (it catches the others): 128 + 9.
    """
    pidfd = None
    if pid > 0:  # -1: the record's pid was already gone (or reused) when it was adopted
        with contextlib.suppress(ProcessLookupError):
            pidfd = os.pidfd_open(pid)
    if pidfd is not None:
        try:
            fields = _stat_fields(pid)
            if fields is not None and fields[0] not in ("Z", "X"):
                await _exited(pidfd)
        finally:
            os.close(pidfd)
    code = read_status(status_file)
    return 128 + signal.SIGKILL if code is None else code


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
    """A returncode (negative for a signal, as ``subprocess`` gives it) in the shell's form
    (128 + signal)."""
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


def process_groups(pids: Iterable[int]) -> dict[int, tuple[int, int]]:
    """Each live (non-zombie) pid of ``pids`` with its process group and session: one
    ``/proc/<pid>/stat`` read each."""
    groups = {}
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is not None and fields[0] not in ("Z", "X"):
            groups[pid] = (int(fields[2]), int(fields[3]))
    return groups


def leader_exited(pid: int) -> bool:
    """Whether the process ``pid`` has exited (or was never there), asked of a pidfd: a poll,
    no ``/proc`` read. A zombie counts as exited. Where pidfds are unavailable (Linux before
    5.3), the fallback is the process's state in ``/proc/<pid>/stat`` (one read, no scan)."""
    if pid <= 0:
        return True
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    except OSError:  # no pidfd_open (ENOSYS) or no permission: read its state instead
        fields = _stat_fields(pid)
        return fields is None or fields[0] in ("Z", "X")
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        return bool(poller.poll(0))
    finally:
        os.close(pidfd)


def group_members(leader: int) -> list[int]:
    """Live (non-zombie) processes whose process group or session is ``leader``'s.

    A scan of ``/proc``: used only while a workload is being ended (to signal and confirm
    every member, forked ones included), never per event or per guard round."""
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


async def pidfd_exited(pidfd: int) -> None:
    """Returns once the process of ``pidfd`` has exited (the pidfd becomes readable)."""
    await _exited(pidfd)


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


def _write_record(path: Path, record: WorkloadRecord) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_bytes(msgspec.json.encode(record))
    os.replace(temporary, path)


def shim_of(status_file: Path) -> int | None:
    """The live shim process writing ``status_file`` (its argv names it), if any."""
    wanted = os.fsencode(status_file)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                words = cmdline.read().split(b"\0")
        except OSError:
            continue
        if wanted in words and SHIM[-1].encode() in words:
            fields = _stat_fields(int(entry))
            if fields is not None and fields[0] not in ("Z", "X"):
                return int(entry)
    return None


class ProcessSupervisor:
    """Starts, waits for and ends workloads. One per node-executor.

    With ``records_dir``, workloads run under the shim and are recorded there, so that
    :meth:`adopt` can take them over after a crash; without it they are started directly
    (and die with nobody to record their end if the executor crashes).
    """

    def __init__(
        self,
        *,
        kill_confirm_seconds: float = DEFAULT_KILL_CONFIRM_SECONDS,
        records_dir: Path | None = None,
    ) -> None:
        self._kill_confirm_seconds = kill_confirm_seconds
        self.records_dir = records_dir
        if records_dir is not None:
            records_dir.mkdir(parents=True, exist_ok=True)

    def _paths(self, pod: PodRef) -> tuple[Path, Path]:
        assert self.records_dir is not None
        stem = f"{pod.namespace}.{pod.name}"
        return self.records_dir / f"{stem}.json", self.records_dir / f"{stem}.status"

    def adopt(self) -> list[Workload]:
        """The workloads a crashed predecessor recorded (alive or already ended)."""
        if self.records_dir is None:
            return []
        adopted = []
        for record_path in sorted(self.records_dir.glob("*.json")):
            try:
                record = msgspec.json.decode(record_path.read_bytes(), type=WorkloadRecord)
            except (OSError, msgspec.DecodeError):
                record_path.unlink(missing_ok=True)
                continue
            status = Path(record.status_file)
            pid = record.pid
            if pid == 0:  # recorded as starting: the executor stopped before it knew the pid
                found = shim_of(status)
                if found is None and not status.exists():
                    # no shim runs with that status file and none wrote it: it never started
                    record_path.unlink(missing_ok=True)
                    continue
                pid = found if found is not None else -1
            elif process_start_ticks(pid) != record.start_ticks:
                pid = -1  # gone (or its pid reused): only the status file can tell its end
            adopted.append(Workload(record.pod, pid, status_file=status, record=record_path))
        return adopted

    async def start(
        self,
        pod: PodRef,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: str,
        fds: StdioFds,
        *,
        run_as: tuple[int, int] | None = None,
        namespaces_of: int | None = None,
        credentials: CallerCredentials | None = None,
    ) -> Workload:
        """Run ``argv`` (no shell) in a new session with ``fds`` as stdin/stdout/stderr.

        ``run_as`` is (uid, gid): the workload runs as that user with no supplementary groups
        (the executor passes the connecting peer's credentials, so no one gains privileges).
        ``namespaces_of`` is a pid (the caller's): the command runs in that process's mount,
        UTS, IPC, network and PID namespaces — in Kubernetes, inside the pod's container, with
        the pod's files — entered by the shim, whose child then drops to the caller's privileges.
        ``credentials`` (the caller's, see :func:`credentials_of`) supersede ``run_as``: the
        command gets the caller's uid, gid and groups and no capability the caller lacked.
        """
        identity: tuple[int, int] | None = None  # Popen's user and group (no extra groups)
        command = list(argv)
        shim_options: list[str] = []
        if credentials is not None:
            shim_options += credentials.shim_options()
        elif run_as is not None and (run_as != (os.getuid(), os.getgid()) or namespaces_of):
            if namespaces_of is None and not (os.geteuid() == 0 and self.records_dir is not None):
                identity = run_as
            else:
                # the shim runs as the executor and drops to the caller for the command only:
                # the executor's interpreter may lie where the caller cannot read (/root)
                shim_options += CallerCredentials(uid=run_as[0], gid=run_as[1]).shim_options()
        if namespaces_of is not None:
            shim_options += ["--enter", str(namespaces_of), "--cwd", cwd]
            cwd = "/"  # the caller's cwd exists in its mount namespace, not necessarily here
        record_path: Path | None = None
        status_file: Path | None = None
        if self.records_dir is not None and argv:
            record_path, status_file = self._paths(pod)
            status_file.unlink(missing_ok=True)
        if argv and (status_file is not None or shim_options):
            status = str(status_file) if status_file is not None else "-"
            command = [sys.executable, *SHIM, status, *shim_options, "--", *command]
        if record_path is not None and status_file is not None:
            # recorded as starting before it starts: a crash in between cannot lose it
            _write_record(
                record_path,
                WorkloadRecord(pod=pod, pid=0, start_ticks=0, status_file=str(status_file)),
            )
        try:
            if not argv:
                raise ValueError("empty command")
            # as asyncio.create_subprocess_exec would start it, but owned by no transport
            process = _Unowned(
                command,
                stdin=fds[0],
                stdout=fds[1],
                stderr=fds[2],
                env=dict(env),
                cwd=cwd,
                close_fds=True,
                start_new_session=True,
                user=None if identity is None else identity[0],
                group=None if identity is None else identity[1],
                extra_groups=None if identity is None else [],
            )
        except (OSError, ValueError) as error:
            if record_path is not None:
                record_path.unlink(missing_ok=True)
            raise WorkloadStartFailed(argv, error) from error
        child = Child(process.pid)
        if record_path is not None and status_file is not None:
            record = WorkloadRecord(
                pod=pod,
                pid=process.pid,
                start_ticks=process_start_ticks(process.pid) or 0,
                status_file=str(status_file),
            )
            _write_record(record_path, record)
        return Workload(pod, child.pid, child=child, status_file=status_file, record=record_path)

    async def wait(self, workload: Workload) -> int:
        """The leader's exit code once it exits (128 + signal when a signal ended it)."""
        return await workload.wait_exit()

    async def terminate(self, workload: Workload, grace_seconds: float) -> Termination:
        """SIGTERM the group, SIGKILL what is left after ``grace_seconds``, confirm it is gone."""
        leader = workload.pid
        # a live leader means a live group: only a leader gone needs the scan for stragglers
        if leader < 0 or (leader_exited(leader) and not group_members(leader)):
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
