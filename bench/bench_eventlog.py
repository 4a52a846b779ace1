"""Event-log throughput against a real nats-server: append awaited one by one,
append_many pipelined, replay (ordered consumer) and a durable subscriber.

    .venv/bin/python bench/bench_eventlog.py [N]

Prints a table of msgs/s; no assertions (the numbers depend on the machine).
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path

from gpupool.eventlog import JetStreamEventLog
from gpupool.eventlog.nats_server import run_nats_server
from gpupool.events import Envelope, PodReady, PodRef

NODES = 8


def envelopes(run: str, n: int) -> list[Envelope]:
    now = datetime(2025, 1, 1, tzinfo=UTC)
    return [
        Envelope(
            id=f"{run}-{i}",
            time=now,
            event=PodReady(
                pod=PodRef(namespace="bench", name=f"pod-{i}"), node=f"node-{i % NODES}"
            ),
        )
        for i in range(n)
    ]


async def timed(n: int, work: Callable[[], Awaitable[object]]) -> float:
    start = time.perf_counter()
    await work()
    return n / (time.perf_counter() - start)


async def main(n: int) -> None:
    with tempfile.TemporaryDirectory(prefix="gpupool-bench-") as store:
        async with run_nats_server(Path(store)) as url:
            one = await JetStreamEventLog.connect(
                url, stream="BENCH_ONE", subject_prefix="bench1.log"
            )
            many = await JetStreamEventLog.connect(
                url, stream="BENCH_MANY", subject_prefix="bench2.log"
            )
            try:

                async def append_each() -> None:
                    for envelope in envelopes("each", n):
                        await one.append(envelope)

                async def append_pipelined() -> None:
                    await many.append_many(envelopes("many", n))

                async def replay() -> None:
                    seen = sum([1 async for _ in many.replay()])
                    assert seen == n, seen

                async def subscribe() -> None:
                    async with many.subscribe(durable="bench") as subscription:
                        seen = 0
                        async for delivery in subscription:
                            await delivery.ack()
                            seen += 1
                            if seen == n:
                                break

                rows = [
                    ("append, each ack awaited", await timed(n, append_each)),
                    ("append_many, pipelined", await timed(n, append_pipelined)),
                    ("replay (ordered consumer)", await timed(n, replay)),
                    ("subscribe + ack (durable pull)", await timed(n, subscribe)),
                ]
            finally:
                await one.close()
                await many.close()
    base = rows[0][1]
    print(f"event log on nats-server, {n} events\n")
    print(f"{'operation':<34}{'msgs/s':>10}{'vs append':>11}")
    for name, rate in rows:
        print(f"{name:<34}{rate:>10,.0f}{rate / base:>10.1f}x")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 20_000))
