"""Per-call cost of the CUDA hook after assignment: an intercepted allocation against the plain
driver, measured in the same run.

    .venv/bin/python bench/bench_cuda_hook.py

A C loop (bench/cuda_hook_alloc_loop.c) does cuMemAlloc_v2 + cuMemFree_v2 pairs of 1 MiB on
the fake CUDA driver of tests/fake_cuda (bookkeeping only, recording off), reaching it through
dlsym or through cuGetProcAddress_v2:

* plain: the driver alone (the baseline);
* hooked: under LD_PRELOAD of the hook, after a Granted with a memory limit and the pod's shared
  counter — every allocation is checked against the limit, counted and remembered.

The Granted comes from a minimal stand-in for the node-executor (this file: it answers the
AttachRequest at once), since what is measured is the cost per call after assignment, not the
queue. The fake driver's calls cost nanoseconds where a real cuMemAlloc costs microseconds, so
the ratio here is an upper bound of the hook's share. Prints a table; no assertions.
"""

from __future__ import annotations

import mmap
import os
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOOK = ROOT / "libs" / "cuda_hook" / "build" / "libgpupool-cuda-hook.so"
DRIVER_DIR = ROOT / "tests" / "fake_cuda" / "build"
LOOP_SOURCE = ROOT / "bench" / "cuda_hook_alloc_loop.c"
PAIRS = 1_000_000
ROUNDS = 5
GRANTED = (
    b'{"type":"Granted","gpu_index":0,"gpu_uuid":"GPU-BENCH-0","memory_limit_bytes":'
    + str(40 << 30).encode()
    + b',"core_percentage":50,"mps_pinned_device_mem_limit":"0=40960M"}\n'
)


def build(work: Path) -> Path:
    subprocess.run(["bash", str(ROOT / "scripts" / "build-cuda-hook.sh")], check=True)
    loop = work / "cuda_hook_alloc_loop"
    cc = os.environ.get("CC", "cc")
    subprocess.run([cc, "-O2", "-o", str(loop), str(LOOP_SOURCE), "-ldl"], check=True)
    return loop


def stand_in_executor(path: Path, stop: threading.Event) -> threading.Thread:
    """Answers every AttachRequest with Granted and a fresh memory counter."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)
    listener.settimeout(0.2)
    kept: list[socket.socket] = []

    def serve() -> None:
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            connection.recv(4096)
            counter = os.memfd_create("gpupool-bench-memory")
            os.ftruncate(counter, mmap.PAGESIZE)
            socket.send_fds(connection, [GRANTED], [counter])
            os.close(counter)
            kept.append(connection)
        for connection in kept:
            connection.close()
        listener.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def measure(loop: Path, route: str, hooked: bool, socket_path: Path) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_CUDA_", "GPUPOOL_"))}
    env["LD_LIBRARY_PATH"] = str(DRIVER_DIR)
    if hooked:
        env["LD_PRELOAD"] = str(HOOK)
        env["GPUPOOL_SOCKET"] = str(socket_path)
        env["GPUPOOL_POD_NAMESPACE"], env["GPUPOOL_POD_NAME"] = "bench", "bench"
    result = subprocess.run(
        [str(loop), route, str(PAIRS), str(ROUNDS)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return float(result.stdout.strip())


def main() -> int:
    with tempfile.TemporaryDirectory() as directory:
        work = Path(directory)
        loop = build(work)
        stop = threading.Event()
        socket_path = work / "executor.sock"
        thread = stand_in_executor(socket_path, stop)
        rows = []
        try:
            for route in ("dlsym", "procaddress"):
                plain = measure(loop, route, False, socket_path)
                hooked = measure(loop, route, True, socket_path)
                rows.append((route, plain, hooked))
        finally:
            stop.set()
            thread.join()
    print(f"cuMemAlloc_v2 + cuMemFree_v2 of 1 MiB, best of {ROUNDS} x {PAIRS:,} pairs")
    print(
        f"{'route':<12} {'plain ns/pair':>14} {'hooked ns/pair':>15} {'overhead ns':>12} {'ratio':>7}"
    )
    for route, plain, hooked in rows:
        print(
            f"{route:<12} {plain:>14.1f} {hooked:>15.1f} {hooked - plain:>12.1f} {hooked / plain:>7.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
