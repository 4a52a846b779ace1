"""The workload shim: the process the node-executor starts, which starts the command.

    python -m gpupool.node_executor.shim STATUS_FILE -- CMD [ARG...]

Like containerd's shim, it exists so that a workload outlives a crash of its
supervisor and its exit status is not lost: it leads the workload's process
group, runs CMD (no shell) as its child in that group, waits for it, writes
CMD's exit status (shell form, 128 + signal) to STATUS_FILE atomically and
exits with it. A restarted node-executor adopts the shim by pid and reads the
status from the file.

The shim catches SIGTERM, SIGINT and SIGHUP and does nothing with them: a
preemption signals the whole group, so CMD gets the signal directly, and the
shim stays to record what CMD did. Caught signals are reset to their defaults
when CMD is exec'd, so CMD sees the standard dispositions. SIGKILL to the group
ends both; then no status is written and the exit is read as 137.

Least privilege: with ``--as UID:GID:GROUPS`` and ``--caps BND:EFF:PRM:INH`` (hex masks, the
caller's own from ``/proc/<pid>/status``), CMD runs with no more privilege than the caller
had: ``no_new_privs`` set, the capability bounding set cut to the caller's, ambient
capabilities cleared, the caller's groups, gid and uid (a uid other than 0 loses every
capability; uid 0 keeps at most the caller's bounding set). With ``--enter PID --cwd DIR``
CMD runs in process PID's mount, UTS, IPC, network and PID namespaces, in DIR there (the
shim itself stays in the executor's mount namespace, where its status file is). STATUS may
be ``-``: no status file.

    python -I -S shim.py STATUS [--enter PID --cwd DIR] [--as U:G:GROUPS --caps B:E:P:I] -- CMD
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

_PR_SET_KEEPCAPS = 8
_PR_CAPBSET_DROP = 24
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_CAP_VERSION_3 = 0x20080522
_NAMESPACES = (("ipc", 0x08000000), ("uts", 0x04000000), ("net", 0x40000000), ("mnt", 0x00020000))
_CLONE_NEWPID = 0x20000000


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


_libc = ctypes.CDLL(None, use_errno=True)  # the interpreter's own libc


def _check(result: int, what: str) -> None:
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{what}: {os.strerror(error)}")


def last_capability() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as last:
            return int(last.read())
    except (OSError, ValueError):
        return 40


class Credentials:
    """Who CMD runs as: uid, gid, groups and the capability masks it may keep."""

    def __init__(
        self, uid: int, gid: int, groups: list[int], bnd: int, eff: int, prm: int, inh: int
    ) -> None:
        self.uid, self.gid, self.groups = uid, gid, groups
        self.bnd, self.eff, self.prm, self.inh = bnd, eff, prm, inh

    @classmethod
    def parse(cls, identity: str, caps: str) -> Credentials:
        uid, gid, groups = identity.split(":")
        bnd, eff, prm, inh = (int(mask, 16) for mask in caps.split(":"))
        return cls(int(uid), int(gid), [int(g) for g in groups.split(",") if g], bnd, eff, prm, inh)


def drop_privileges(credentials: Credentials) -> None:
    """In the process about to exec CMD: no more privilege than ``credentials`` allow."""
    _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    for cap in range(last_capability() + 1):
        if not credentials.bnd >> cap & 1:
            _check(_libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0), f"dropping capability {cap}")
    _libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)  # (absent before 4.3)
    os.setgroups(credentials.groups)
    os.setresgid(credentials.gid, credentials.gid, credentials.gid)
    if credentials.uid == 0:
        # root keeps at most the caller's bounding set on exec; its sets now are the caller's
        # (within what this process holds: a capability the executor lacks cannot be given)
        ceiling = credentials.bnd & _own_permitted()
        data = (_CapData * 2)()
        for word in range(2):
            data[word].effective = (credentials.eff & ceiling) >> (32 * word) & 0xFFFFFFFF
            data[word].permitted = (credentials.prm & ceiling) >> (32 * word) & 0xFFFFFFFF
            data[word].inheritable = (credentials.inh & ceiling) >> (32 * word) & 0xFFFFFFFF
        header = _CapHeader(_CAP_VERSION_3, 0)
        _check(_libc.capset(ctypes.byref(header), data), "capset")
    else:
        _libc.prctl(_PR_SET_KEEPCAPS, 0, 0, 0, 0)  # setuid away from 0 clears every capability
        os.setresuid(credentials.uid, credentials.uid, credentials.uid)


def unreachable_for(program: str, credentials: Credentials) -> str | None:
    """Why ``credentials`` cannot run ``program`` (as found on PATH): the first directory on
    the way to it (links resolved) they may not search, or the file they may not execute."""
    found = shutil.which(program) if os.sep not in program else program
    if found is None:
        return None
    target = os.path.realpath(found)
    via = f"{found} is {target}, and " if target != found else ""
    parts = Path(target).parts
    for depth in range(1, len(parts) + 1):
        path = str(Path(*parts[:depth]))
        try:
            info = os.stat(path)
        except OSError:
            return None
        last = depth == len(parts)
        if not _may(info, credentials, 0o1):
            what = "execute" if last else "search"
            return (
                f"permission denied: {via}uid {credentials.uid} may not {what} {path} "
                f"(mode {info.st_mode & 0o777:o}, owner {info.st_uid}:{info.st_gid}); "
                "the command runs as the caller, so it must lie where the caller can reach it"
            )
    return None


def _may(info: os.stat_result, credentials: Credentials, bit: int) -> bool:
    """Whether the caller's uid, gid and groups have ``bit`` (1: x) on a file or directory."""
    if credentials.uid == 0:
        return True
    if info.st_uid == credentials.uid:
        return bool(info.st_mode >> 6 & bit)
    if info.st_gid == credentials.gid or info.st_gid in credentials.groups:
        return bool(info.st_mode >> 3 & bit)
    return bool(info.st_mode & bit)


def _own_permitted() -> int:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("CapPrm:"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        pass
    return 0


def enter_namespaces(namespace_fds: list[tuple[int, int]], cwd: str) -> None:
    for fd, kind in namespace_fds:
        _check(_libc.setns(fd, kind), f"setns {kind:#x}")
    os.chdir(cwd)


def write_status(path: Path | None, code: int) -> None:
    if path is None:
        return
    # not path.with_suffix(".tmp"): that is where the executor writes the workload's record
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(f"{code}\n")
    os.replace(temporary, path)


USAGE = (
    "usage: python -m gpupool.node_executor.shim STATUS_FILE [--enter PID --cwd DIR]"
    " [--as UID:GID:GROUPS --caps BND:EFF:PRM:INH] -- CMD [ARG...]"
)


def main(argv: list[str]) -> int:
    if "--" not in argv or len(argv) < 3:
        print(USAGE, file=sys.stderr)
        return 2
    split = argv.index("--")
    options, command = argv[1:split], argv[split + 1 :]
    status = None if argv[0] == "-" else Path(argv[0])
    values = dict(zip(options[::2], options[1::2], strict=False))
    if not command or len(options) % 2 or set(values) - {"--enter", "--cwd", "--as", "--caps"}:
        print(USAGE, file=sys.stderr)
        return 2
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda *_: None)
    namespace_fds: list[tuple[int, int]] = []
    credentials: Credentials | None = None
    try:
        if "--as" in values:
            credentials = Credentials.parse(values["--as"], values.get("--caps", "0:0:0:0"))
        if "--enter" in values:
            target = int(values["--enter"])
            pid_ns = os.open(f"/proc/{target}/ns/pid", os.O_RDONLY)
            namespace_fds = [
                (os.open(f"/proc/{target}/ns/{name}", os.O_RDONLY), kind)
                for name, kind in _NAMESPACES
            ]
            _check(_libc.setns(pid_ns, _CLONE_NEWPID), "setns pid")  # for CMD, our child
            os.close(pid_ns)
    except (OSError, ValueError) as error:
        print(f"gpupool: cannot prepare {command[0]!r}: {error}", file=sys.stderr)
        write_status(status, 126)
        return 126
    cwd = values.get("--cwd", "/")

    def prepare() -> None:  # in the child, before exec: the caller's namespaces, its privileges
        if namespace_fds:
            enter_namespaces(namespace_fds, cwd)
        if credentials is not None:
            drop_privileges(credentials)

    try:
        # inherits stdio, group and session; no shell
        child = subprocess.Popen(command, preexec_fn=prepare)  # the shim has one thread
    except (OSError, subprocess.SubprocessError) as error:
        code = 127 if isinstance(error, FileNotFoundError) else 126
        why = str(error)
        if isinstance(error, PermissionError) and credentials is not None:
            why = unreachable_for(command[0], credentials) or why
        print(f"gpupool: cannot start {command[0]!r}: {why}", file=sys.stderr)
        write_status(status, code)
        return code
    for fd, _kind in namespace_fds:
        os.close(fd)
    while True:
        try:
            returncode = child.wait()
            break
        except InterruptedError:  # pragma: no cover - PEP 475 retries for us
            continue
    code = 128 - returncode if returncode < 0 else returncode
    write_status(status, code)
    return code


if __name__ == "__main__":
    sys.stdout.flush()
    os._exit(main(sys.argv[1:]))
