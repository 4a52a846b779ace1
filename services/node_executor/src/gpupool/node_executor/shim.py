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
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path


def write_status(path: Path, code: int) -> None:
    # not path.with_suffix(".tmp"): that is where the executor writes the workload's record
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(f"{code}\n")
    os.replace(temporary, path)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print(
            "usage: python -m gpupool.node_executor.shim STATUS_FILE -- CMD [ARG...]",
            file=sys.stderr,
        )
        return 2
    status = Path(argv[0])
    command = argv[2:]
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda *_: None)
    try:
        child = subprocess.Popen(command)  # inherits stdio, group and session; no shell
    except OSError as error:
        code = 127 if isinstance(error, FileNotFoundError) else 126
        print(f"gpupool: cannot start {command[0]!r}: {error.strerror}", file=sys.stderr)
        write_status(status, code)
        return code
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
