"""The admission-queue's CPU per placement in a burst, and the CPU of one ack: the steadier
figures beside bench_decisions.py's burst rows on a shared machine.

    .venv/bin/python bench/bench_transport.py [--rounds 3] [--burst 2000]

* CPU per placement: bench_decisions' burst with the PodReady published by another
  process, on 1, 16, 256, 1,024 nodes; this process's ``time.process_time()`` from the
  publisher's start to the burst's end (the admission-queue alone; the publisher and
  the server are other processes), divided by the placements; the median of
  ``--rounds`` bursts, beside the wall-clock placements/s.
* one ack: 20,000 acks on one connection, as ``Msg.ack()`` (a nats-py publish) and,
  where the code has it, as a frame (``gpupool.eventlog.wire``); CPU µs per ack.

Run it on two trees with their ``libs/`` first on ``PYTHONPATH`` for an A/B
(docs/benchmarks.md, "The transport on raw subscriptions"). Prints; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from nats.aio.msg import Msg

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decisions
from gpupool.eventlog.log_client import LogClient
from gpupool.eventlog.nats_server import run_nats_server

ACKS = 20_000
REPLY = "$JS.ACK.GPUPOOL.admission-queue-0.1.12345.12345.1733000000000000000.0"


async def cpu_per_placement(url: str, workdir: Path, burst: int, rounds: int) -> None:
    started: dict[str, float] = {}
    go = bench_decisions.SeparatePublisher.go

    def timed_go(self: bench_decisions.SeparatePublisher) -> None:
        started["cpu"] = time.process_time()
        go(self)

    bench_decisions.SeparatePublisher.go = timed_go  # type: ignore[method-assign]
    server = bench_decisions.Server(url)
    print("| nodes | CPU µs per placement (median) | placements/s (median) |")
    print("|---|---|---|")
    for nodes in (1, 16, 256, 1024):
        cpus, rates = [], []
        for _ in range(rounds):
            per_second, _ = await bench_decisions.burst(server, burst, nodes, separate=workdir)
            cpus.append((time.process_time() - started["cpu"]) / burst * 1e6)
            rates.append(per_second)
        print(f"| {nodes} | {statistics.median(cpus):.0f} | {statistics.median(rates):,.0f} |")


async def ack_cost(url: str) -> None:
    nc = LogClient()
    await nc.connect(url)
    try:
        msgs = [Msg(nc, subject="x", reply=REPLY, data=b"") for _ in range(ACKS)]
        begin = time.process_time()
        for index, msg in enumerate(msgs):
            await msg.ack()
            if index % 1000 == 999:
                await asyncio.sleep(0)  # let the flusher write, as a consumer's loop does
        print(f"\nMsg.ack(): {(time.process_time() - begin) / ACKS * 1e6:.2f} µs of CPU per ack")
        await nc.flush()
        try:
            from gpupool.eventlog.wire import ack_frame, send_frame
        except ImportError:  # the code before the raw transport
            return
        reply = REPLY.encode()
        begin = time.process_time()
        for index in range(ACKS):
            await send_frame(nc, ack_frame(reply))
            if index % 1000 == 999:
                await asyncio.sleep(0)
        print(f"ack frame: {(time.process_time() - begin) / ACKS * 1e6:.2f} µs of CPU per ack")
        await nc.flush()
    finally:
        await nc.close()


async def main(burst: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory(prefix="gpupool-bench-") as tmp:
        async with run_nats_server(Path(tmp)) as url:
            await cpu_per_placement(url, Path(tmp), burst, rounds)
            await ack_cost(url)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--burst", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    asyncio.run(main(options.burst, options.rounds))
