"""PodReady -> Assigned latency through all four services, against the raw JetStream round trip.

Starts the local stack (real nats-server, the four services as processes, 8 SIMULATED
GPUs), then runs workloads through the node-executor's socket exactly as `gpupool run`
does (in-process clients; each command is a real `true` process). Latency is read from
the log's own timestamps (PodReady.time -> Assigned.time). The baseline, measured in the
same run on the same server: one JetStream publish -> the same message arriving at an
ordered consumer. Prints tables; asserts nothing.

    python bench/bench_services.py [--pods 200] [--gpus 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import nats

from gpupool.cli.local_stack import StackSettings, local_stack
from gpupool.eventlog.jetstream import JetStreamEventLog
from gpupool.eventlog.port import StoredEvent
from gpupool.events import Assigned, PodReady, PodRef
from gpupool.workload import Rejected, RunRequest
from gpupool.workload.client import run_workload

NODE = "bench-node"


def cluster_yaml(pods: int, gpus: int) -> str:
    lines = [
        "nodes:",
        f"  - {{name: {NODE}, gpus: {gpus}, policy: share-pool}}",
        "pods:",
    ]
    for i in range(pods):
        lines.append(
            f"  - {{name: p{i:04d}, node: {NODE}, requests: {{core: 1, memory: 1}}, "
            "limits: {core: 50, memory: 50}}"
        )
    return "\n".join(lines) + "\n"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


async def raw_round_trip(url: str, count: int) -> list[float]:
    """Publish to a JetStream stream and time the arrival at an ordered consumer."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.add_stream(name="BENCH_RTT", subjects=["bench.rtt"])
    arrived: asyncio.Queue[float] = asyncio.Queue()

    async def on_msg(msg: object) -> None:
        arrived.put_nowait(time.perf_counter())

    await js.subscribe("bench.rtt", cb=on_msg, ordered_consumer=True)
    samples = []
    for _ in range(count):
        sent = time.perf_counter()
        await js.publish("bench.rtt", b"x")
        samples.append((await arrived.get()) - sent)
    await nc.close()
    return samples


async def run_pods(socket: Path, pods: int, concurrency: int) -> None:
    devnull = os.open(os.devnull, os.O_RDWR)
    semaphore = asyncio.Semaphore(concurrency)

    async def one(index: int) -> int:
        async with semaphore:
            request = RunRequest(
                pod=PodRef(namespace="default", name=f"p{index:04d}"),
                argv=["true"],
                cwd="/",
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            )
            return await run_workload(
                socket, request, on_message=note, fds=(devnull, devnull, devnull)
            )

    rejections: list[str] = []

    def note(message: object) -> None:
        if isinstance(message, Rejected):
            rejections.append(f"{message.reason}: {message.message}")

    codes = await asyncio.gather(*(one(i) for i in range(pods)))
    os.close(devnull)
    failed = [c for c in codes if c != 0]
    if failed:
        print(f"warning: {len(failed)} runs did not exit 0: {rejections[:3]}", file=sys.stderr)


async def main(pods: int, gpus: int, concurrency: int) -> None:
    with tempfile.TemporaryDirectory(prefix="gpupool-bench-") as tmp:
        cluster = Path(tmp) / "cluster.yaml"
        cluster.write_text(cluster_yaml(pods, gpus))
        settings = StackSettings(
            cluster_file=cluster,
            node=NODE,
            state_dir=Path(tmp) / "state",
            simulate_gpus=gpus,
            log_level="WARNING",
        )
        async with local_stack(settings) as stack:
            baseline = await raw_round_trip(stack.nats_url, 1000)
            started = time.perf_counter()
            await run_pods(stack.socket_path, pods, concurrency)
            elapsed = time.perf_counter() - started
            log = await JetStreamEventLog.connect(stack.nats_url)
            entries = [e async for e in log.replay()]
            await log.close()
    ready: dict[PodRef, float] = {}
    latencies: list[float] = []
    assigned_times: list[float] = []
    for entry in entries:
        if not isinstance(entry, StoredEvent):
            continue
        event, when = entry.envelope.event, entry.envelope.time.timestamp()
        if isinstance(event, PodReady):
            ready[event.pod] = when
        elif isinstance(event, Assigned) and event.pod in ready:
            latencies.append(when - ready.pop(event.pod))
            assigned_times.append(when)
    span = max(assigned_times) - min(assigned_times) if len(assigned_times) > 1 else float("nan")
    ms = 1000.0
    print(
        f"{pods} pods, {gpus} simulated GPUs, {concurrency} concurrent clients, limits 50% "
        f"(2 per GPU), each command a real `true` process; {os.cpu_count()} CPUs\n"
    )
    print(f"{'measure':<44}{'p50 ms':>10}{'p99 ms':>10}{'mean ms':>10}")
    rows = [
        ("raw JetStream publish -> ordered consumer", baseline),
        ("PodReady -> Assigned through all services", latencies),
    ]
    for name, values in rows:
        print(
            f"{name:<44}{percentile(values, 0.5) * ms:>10.2f}{percentile(values, 0.99) * ms:>10.2f}"
            f"{statistics.fmean(values) * ms:>10.2f}"
        )
    ratio = percentile(latencies, 0.5) / percentile(baseline, 0.5)
    print(f"\nratio PodReady->Assigned p50 / raw round trip p50: {ratio:.1f}x")
    print(f"placements per second (first to last Assigned): {len(assigned_times) / span:.1f}")
    print(f"whole runs per second (ready -> ran -> released, end to end): {pods / elapsed:.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=200)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument(
        "--concurrency",
        type=int,
        default=16,
        help="concurrent clients (default 16 = the capacity: nobody waits for a GPU)",
    )
    options = parser.parse_args()
    asyncio.run(main(options.pods, options.gpus, options.concurrency))
