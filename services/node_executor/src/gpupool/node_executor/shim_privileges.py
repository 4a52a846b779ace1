"""The shim's privilege drop and namespace entry: prctl, capset and setns through libc.

Imported by :mod:`.shim_main` only when a command is started with ``--as`` or ``--enter``.
It calls libc through ``ctypes`` (its public interface, not the private ``_ctypes`` module
behind it: a privilege drop is not the place to depend on an interpreter's internals,
and ``ctypes`` costs such a start only a few milliseconds of CPU more). ``posix``, not
``os``. :func:`unreachable_for` explains a refused exec; it imports ``os``, ``shutil`` and
``pathlib`` itself, on that failure path only.
"""

import ctypes
import posix

_PR_SET_KEEPCAPS = 8
_PR_CAPBSET_DROP = 24
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_CAP_VERSION_3 = 0x20080522
NAMESPACES = (("ipc", 0x08000000), ("uts", 0x04000000), ("net", 0x40000000), ("mnt", 0x00020000))
"""The namespaces CMD joins (name under ``/proc/<pid>/ns``, setns type); the PID one apart."""
CLONE_NEWPID = 0x20000000


class _CapHeader(ctypes.Structure):
    _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))


class _CapData(ctypes.Structure):
    _fields_ = (
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    )


_libc = ctypes.CDLL(None, use_errno=True)  # the interpreter's own libc
_prctl = _libc.prctl
_capset = _libc.capset
_setns = _libc.setns


def _check(result: int, what: str) -> None:
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{what}: {posix.strerror(error)}")


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
    def parse(cls, identity: str, caps: str) -> "Credentials":
        uid, gid, groups = identity.split(":")
        bnd, eff, prm, inh = (int(mask, 16) for mask in caps.split(":"))
        return cls(int(uid), int(gid), [int(g) for g in groups.split(",") if g], bnd, eff, prm, inh)


def drop_privileges(credentials: Credentials) -> None:
    """In the process about to exec CMD: no more privilege than ``credentials`` allow."""
    _check(_prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    for cap in range(last_capability() + 1):
        if not credentials.bnd >> cap & 1:
            _check(_prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0), f"dropping capability {cap}")
    _prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)  # (absent before 4.3)
    posix.setgroups(credentials.groups)
    posix.setresgid(credentials.gid, credentials.gid, credentials.gid)
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
        _check(_capset(ctypes.byref(header), data), "capset")
    else:
        _prctl(_PR_SET_KEEPCAPS, 0, 0, 0, 0)  # setuid away from 0 clears every capability
        posix.setresuid(credentials.uid, credentials.uid, credentials.uid)


def unreachable_for(program: str, credentials: Credentials) -> str | None:
    """Why ``credentials`` cannot run ``program`` (as found on PATH): the first directory on
    the way to it (links resolved) they may not search, or the file they may not execute."""
    import os  # only here: a refused exec, not every start, pays for them
    import shutil
    from pathlib import Path

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


def _may(info: posix.stat_result, credentials: Credentials, bit: int) -> bool:
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


def open_namespaces(target: int) -> list[tuple[int, int]]:
    """Join ``target``'s PID namespace for our children (CMD) and open its other namespaces
    for CMD to join (:func:`enter_namespaces`, in the child)."""
    pid_ns = posix.open(f"/proc/{target}/ns/pid", posix.O_RDONLY)
    namespace_fds = [
        (posix.open(f"/proc/{target}/ns/{name}", posix.O_RDONLY), kind) for name, kind in NAMESPACES
    ]
    _check(_setns(pid_ns, CLONE_NEWPID), "setns pid")  # for CMD, our child
    posix.close(pid_ns)
    return namespace_fds


def enter_namespaces(namespace_fds: list[tuple[int, int]], cwd: str) -> None:
    for fd, kind in namespace_fds:
        _check(_setns(fd, kind), f"setns {kind:#x}")
    posix.chdir(cwd)
