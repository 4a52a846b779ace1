"""The shim's work (see :mod:`.shim` for what it does): parse, start CMD, wait, record.

A shim starts with every workload, so its start-up is the workload's CPU: this module
imports only modules the interpreter has loaded before it runs a line — ``sys``, ``posix``
(the functions ``os`` re-exports; ``os`` itself adds ``_collections_abc``, ``stat`` and
``posixpath``) and ``_signal`` (the C module behind ``signal``, which would add ``enum``) —
and :mod:`.shim_privileges` (libc through ``ctypes``) only for ``--as``/``--enter``. CMD is started as
``subprocess`` would start it (``restore_signals``, ``close_fds``; a PATH search where the
first error other than "not found" wins): fork, exec, and a close-on-exec pipe that brings a
failure in the child (preparing it, or the exec) back to the shim.
"""

import _signal  # type: ignore[import-not-found]  # (no stub: the C module behind signal)
import posix
import sys

TYPE_CHECKING = False  # not typing's: importing typing costs more than the rest of the shim
if TYPE_CHECKING:
    from collections.abc import Callable

    from gpupool.node_executor.shim_privileges import Credentials

CAUGHT = (_signal.SIGTERM, _signal.SIGINT, _signal.SIGHUP)
"""Caught by the shim and ignored: a preemption signals the group, CMD acts on it."""
RESTORED = (_signal.SIGPIPE, _signal.SIGXFSZ)
"""Ignored by the interpreter at start-up; CMD gets them at their defaults (``subprocess``'s
``restore_signals``)."""

USAGE = (
    "usage: python -m gpupool.node_executor.shim STATUS_FILE [--enter PID --cwd DIR]"
    " [--as UID:GID:GROUPS --caps BND:EFF:PRM:INH] -- CMD [ARG...]"
)


def write_status(path: str | None, code: int) -> None:
    """``code`` to ``path`` atomically: through a temporary of its own, then renamed."""
    if path is None:
        return
    # not <stem>.tmp: that is where the executor writes the workload's record
    temporary = path + ".tmp"
    fd = posix.open(temporary, posix.O_WRONLY | posix.O_CREAT | posix.O_TRUNC, 0o666)
    try:
        posix.write(fd, b"%d\n" % code)
    finally:
        posix.close(fd)
    posix.replace(temporary, path)


def shell_code(wait_status: int) -> int:
    """A ``waitpid`` status in the shell's form: the exit code, or 128 + the signal."""
    returncode = posix.waitstatus_to_exitcode(wait_status)
    return 128 - returncode if returncode < 0 else returncode


class StartFailed(Exception):
    """CMD could not be started: preparing the child failed (``exec_error`` None) or its exec
    did (``exec_error``: what ``subprocess`` would have raised)."""

    def __init__(self, message: str, exec_error: OSError | None = None) -> None:
        super().__init__(message)
        self.message, self.exec_error = message, exec_error


def _close_inherited(keep: int) -> None:
    """Close every inheritable descriptor above stderr but ``keep`` (``close_fds``): CMD
    gets only its stdio. (The shim's own descriptors are close-on-exec already.)"""
    try:
        names = posix.listdir("/proc/self/fd")
    except OSError:
        return
    for name in names:
        fd = int(name)
        if fd > 2 and fd != keep:
            try:
                if posix.get_inheritable(fd):
                    posix.close(fd)
            except OSError:
                pass  # the listing's own descriptor, closed already


DEFAULT_PATH = b"/bin:/usr/bin"
"""``os.defpath``: where CMD is looked for when the environment has no PATH."""


def exec_on_path(command: list[str]) -> None:
    """``os.execvp`` (and ``subprocess``'s exec) without importing ``os``: CMD itself if it
    names a directory, else each directory of PATH in turn; raises the first error that is
    not ENOENT/ENOTDIR (say, EACCES), or else the last one."""
    program = command[0]
    if "/" in program:
        posix.execv(program, command)
    path = posix.environ.get(b"PATH", DEFAULT_PATH)
    first: OSError | None = None
    last: OSError | None = None
    for directory in path.decode(sys.getfilesystemencoding(), "surrogateescape").split(":"):
        joined = directory + program if directory.endswith("/") or not directory else None
        try:
            posix.execv(joined or f"{directory}/{program}", command)
        except (FileNotFoundError, NotADirectoryError) as error:
            last = error
        except OSError as error:
            last = error
            first = first or error
    raise first or last or FileNotFoundError(2, posix.strerror(2), program)


def _child(command: list[str], prepare: "Callable[[], None] | None", report: int) -> None:
    """In the forked child: CMD's dispositions, its preparation, the exec. Never returns."""
    stage = "prepare"
    try:
        for signum in CAUGHT + RESTORED:
            _signal.signal(signum, _signal.SIG_DFL)
        _close_inherited(keep=report)
        if prepare is not None:
            prepare()
        stage = "exec"
        exec_on_path(command)
    except BaseException as error:
        number = error.errno if isinstance(error, OSError) and error.errno else 0
        try:
            posix.write(report, f"{stage}:{number}:{error}".encode(errors="replace"))
        finally:
            posix._exit(255)
    posix._exit(255)  # pragma: no cover - execvp returns only by raising


def start(command: list[str], prepare: "Callable[[], None] | None") -> int:
    """Fork and exec CMD (in the shim's process group, no shell); its pid, or StartFailed."""
    read_end, write_end = posix.pipe()  # close-on-exec: EOF once CMD is exec'd
    pid = posix.fork()
    if pid == 0:
        posix.close(read_end)
        _child(command, prepare, write_end)
    posix.close(write_end)
    report = b""
    while chunk := posix.read(read_end, 4096):
        report += chunk
    posix.close(read_end)
    if not report:
        return pid
    posix.waitpid(pid, 0)  # the failed child
    stage, _, rest = report.decode(errors="replace").partition(":")
    number, _, message = rest.partition(":")
    if stage == "exec" and number.isdigit() and int(number):
        # as subprocess raises it: FileNotFoundError(2, "No such file or directory", CMD)
        error = OSError(int(number), posix.strerror(int(number)), command[0])
        raise StartFailed(str(error), error)
    raise StartFailed(message)


def wait(pid: int) -> int:
    """CMD's exit status in shell form (the wait is retried after a caught signal)."""
    _, wait_status = posix.waitpid(pid, 0)
    return shell_code(wait_status)


def main(argv: list[str]) -> int:
    if "--" not in argv or len(argv) < 3:
        print(USAGE, file=sys.stderr)
        return 2
    split = argv.index("--")
    options, command = argv[1:split], argv[split + 1 :]
    status = None if argv[0] == "-" else argv[0]
    values = dict(zip(options[::2], options[1::2], strict=False))
    if not command or len(options) % 2 or set(values) - {"--enter", "--cwd", "--as", "--caps"}:
        print(USAGE, file=sys.stderr)
        return 2
    for signum in CAUGHT:
        _signal.signal(signum, lambda *_: None)
    namespace_fds: list[tuple[int, int]] = []
    credentials: Credentials | None = None
    if "--as" in values or "--enter" in values:
        from gpupool.node_executor import shim_privileges as privileges
    try:
        if "--as" in values:
            credentials = privileges.Credentials.parse(
                values["--as"], values.get("--caps", "0:0:0:0")
            )
        if "--enter" in values:
            namespace_fds = privileges.open_namespaces(int(values["--enter"]))
    except (OSError, ValueError) as error:
        print(f"gpupool: cannot prepare {command[0]!r}: {error}", file=sys.stderr)
        write_status(status, 126)
        return 126
    cwd = values.get("--cwd", "/")

    def prepare() -> None:  # in the child, before exec: the caller's namespaces, its privileges
        if namespace_fds:
            privileges.enter_namespaces(namespace_fds, cwd)
        if credentials is not None:
            privileges.drop_privileges(credentials)

    try:
        # inherits stdio, group and session; no shell
        child = start(command, prepare if namespace_fds or credentials is not None else None)
    except StartFailed as failure:
        code = 127 if isinstance(failure.exec_error, FileNotFoundError) else 126
        why = failure.message
        if isinstance(failure.exec_error, PermissionError) and credentials is not None:
            why = privileges.unreachable_for(command[0], credentials) or why
        print(f"gpupool: cannot start {command[0]!r}: {why}", file=sys.stderr)
        write_status(status, code)
        return code
    for fd, _kind in namespace_fds:
        posix.close(fd)
    code = wait(child)
    write_status(status, code)
    return code


def run() -> None:
    """The shim as a program: exits with CMD's status."""
    sys.stdout.flush()
    posix._exit(main(sys.argv[1:]))
