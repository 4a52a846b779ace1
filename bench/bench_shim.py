"""The CPU of one workload shim start, against the bare interpreter measured in the same run.

    .venv/bin/python bench/bench_shim.py [--runs 100] [--shim PATH ...]

Each row starts real processes one at a time and takes the user + system CPU of each
(``os.wait4``: the process and the children it waited for, so a shim's row holds its
command's too): the bare interpreter (``python -I -S -c pass``), the command alone
(``true``), and each shim (default: the node-executor's own; ``--shim`` adds others, say an
older ``shim.py`` kept in the same directory, for an A/B) started as the executor starts
it — plain (``STATUS -- true``) and, as a root executor always does, with the caller's
credentials (``--as``/``--caps``, this process's own). The rows are interleaved run by run,
so a change in the machine's load touches them alike. Prints medians and p10–p90; asserts
nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from gpupool.node_executor.processes import SHIM, credentials_of


def cpu_ms(argv: list[str]) -> float:
    """User + system CPU of one run of ``argv`` (and what it waited for), in ms."""
    pid = os.posix_spawnp(argv[0], argv, os.environ)
    _, status, usage = os.wait4(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{argv} failed: {os.waitstatus_to_exitcode(status)}")
    return (usage.ru_utime + usage.ru_stime) * 1000


def rows(shims: list[str], status: Path) -> dict[str, list[str]]:
    credentials = credentials_of(os.getpid(), os.getuid(), os.getgid())
    commands = {
        "python -I -S -c pass (bare interpreter)": [sys.executable, "-I", "-S", "-c", "pass"],
        "true (the command alone)": ["true"],
    }
    for shim in shims:
        start = [sys.executable, "-I", "-S", shim, str(status)]
        commands[f"{shim}: STATUS -- true"] = [*start, "--", "true"]
        commands[f"{shim}: STATUS --as --caps -- true"] = [
            *start,
            *credentials.shim_options(),
            "--",
            "true",
        ]
    return commands


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--shim", action="append", default=[], help="another shim.py to measure")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        commands = rows([SHIM[-1], *args.shim], Path(directory) / "bench.status")
        for argv in commands.values():
            cpu_ms(argv)  # warm: bytecode caches written, files in the page cache
        samples: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.runs):
            for name, argv in commands.items():
                samples[name].append(cpu_ms(argv))
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print(f"CPU of one start, {args.runs} runs each, interleaved; load {load}; uid {os.getuid()}")
    bare = statistics.median(samples["python -I -S -c pass (bare interpreter)"])
    alone = statistics.median(samples["true (the command alone)"])
    for name, values in samples.items():
        ordered = sorted(values)
        median = statistics.median(ordered)
        p10, p90 = ordered[len(ordered) // 10], ordered[len(ordered) * 9 // 10]
        over = f"  (+{median - bare - alone:.1f} over bare + true)" if ":" in name else ""
        print(f"  {name:<64} {median:6.1f} ms  ({p10:.1f}–{p90:.1f}){over}")


if __name__ == "__main__":
    main()
