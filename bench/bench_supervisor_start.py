"""The executor's own CPU to start a workload through the shim and wait for its end.

Runs ``ProcessSupervisor.start`` (with a records directory, so through the shim, with the
two record writes) and ``wait`` for ``true``, one workload at a time, and prints the
executor's CPU per workload (``time.process_time``: this process and its threads, not the
children), median and range over rounds. The baseline is the same loop's bare start of the
shim with ``subprocess.Popen`` and a blocking ``waitpid`` (no event loop, no records), in
the same run.

    .venv/bin/python bench/bench_supervisor_start.py [starts-per-round] [rounds]
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpupool.events import PodRef
from gpupool.node_executor.processes import SHIM, ProcessSupervisor

POD = PodRef(namespace="default", name="bench")


async def supervised_round(records: Path, starts: int, devnull: int) -> float:
    supervisor = ProcessSupervisor(records_dir=records)
    begin = time.process_time()
    for _ in range(starts):
        workload = await supervisor.start(
            POD, ["true"], {"PATH": os.environ["PATH"]}, "/", (devnull, devnull, devnull)
        )
        assert await supervisor.wait(workload) == 0
        workload.forget()
    return (time.process_time() - begin) * 1000 / starts


def raw_round(starts: int, devnull: int) -> float:
    begin = time.process_time()
    for _ in range(starts):
        child = subprocess.Popen(
            [sys.executable, *SHIM, "-", "--", "true"],
            stdin=devnull,
            stdout=devnull,
            stderr=devnull,
            start_new_session=True,
        )
        assert child.wait() == 0
    return (time.process_time() - begin) * 1000 / starts


def main() -> None:
    starts = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    devnull = os.open(os.devnull, os.O_RDWR)
    supervised: list[float] = []
    raw: list[float] = []
    with tempfile.TemporaryDirectory() as directory:
        for _ in range(rounds):
            raw.append(raw_round(starts, devnull))
            supervised.append(asyncio.run(supervised_round(Path(directory), starts, devnull)))
    print(f"python {sys.version.split()[0]}, {rounds} rounds of {starts} starts of `true`")
    print("| executor CPU per workload | median | range |")
    print("|---|---|---|")
    for name, values in (("ProcessSupervisor.start + wait", supervised), ("raw Popen", raw)):
        print(
            f"| {name} | {statistics.median(values):.2f} ms | {min(values):.2f}–{max(values):.2f} |"
        )
    ratio = statistics.median(supervised) / statistics.median(raw)
    print(f"supervised / raw: {ratio:.2f}×; load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
