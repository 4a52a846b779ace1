"""The node-executor's share of the log: deliveries and CPU per placement of its own node,
with 1 and 16 nodes of traffic, reading its node's partition against reading the whole log.

    .venv/bin/python bench/bench_executor.py [--placements 300] [--nodes 1,16]

A real nats-server (started here). Each node has one GPU and one pod, placed and released
``--placements`` times: PodReady, Assigned, Released, decided by the pure core, appended
round-robin over the nodes (so one node's entries are 1/N of the stream). Then a node-executor's
decider loop (as the service runs it, with its react filtering its node) consumes the stream
from its start through a durable consumer, once reading only its node
(``partition=<node>``, what the service does) and once the whole log (the service before);
its process CPU while it consumes is measured with ``time.process_time`` (the traffic is in
the stream before it starts, so the CPU is the consumer's alone), and its deliveries counted.
The ratio row is whole-log / partition in the same run.

A second table is the memory guard's round with 16 running commands (real processes, each
the leader of its own session, with a child each): finding each command's processes as it did
before (a scan of ``/proc`` per command, ``group_members``) against what it does now (the
pids a GPU sample names, one ``/proc/<pid>/stat`` read each per round, ``process_groups``; and a pidfd
poll per leader, ``leader_exited``), in the same run, with the number of processes the node
runs beside it. Asserts only that the executor set nothing aside (else it would measure
refusals); the figures depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import time
import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from gpupool.core import ReportRelease, RequestGpu, Schedule, State, decide, evolve
from gpupool.eventlog import JetStreamEventLog, StoredEvent
from gpupool.eventlog.nats_server import run_nats_server
from gpupool.events import (
    Envelope,
    Event,
    GpuInventoryReported,
    NodeConfigured,
    PodRef,
    PodRegistered,
    QosConfig,
    Share,
)
from gpupool.gpus import simulated_inventory
from gpupool.runtime.decider import DeciderLoop

T0 = datetime(2025, 4, 22, 8, 0, 0, tzinfo=UTC)


def node_name(index: int) -> str:
    return f"gpu-node-{index}"


def traffic(nodes: int, placements: int) -> list[Envelope]:
    """Every node's set-up, then its placements round-robin, decided by the core."""
    state = State()
    envelopes: list[Envelope] = []
    now = T0

    def add(events: list[Event]) -> None:
        nonlocal now
        for event in events:
            now += timedelta(milliseconds=1)
            envelope = Envelope(id=uuid.uuid4().hex, time=now, event=event)
            evolve(state, envelope)
            envelopes.append(envelope)

    pods = {}
    for index in range(nodes):
        node = node_name(index)
        pods[node] = PodRef(namespace="bench", name=f"pod-{index}")
        add(
            [
                GpuInventoryReported(
                    node=node, gpus=simulated_inventory(1, node=node).gpus, source="simulated"
                ),
                NodeConfigured(node=node, policy="share-pool", qos=QosConfig(), gpu_count=1),
                PodRegistered(
                    pod=pods[node],
                    node=node,
                    policy="share-pool",
                    requests=Share(core=50, memory=50),
                    limits=Share(core=50, memory=50),
                ),
            ]
        )
    for _ in range(placements):
        for node, pod in pods.items():
            add(decide(state, RequestGpu(pod=pod, node=node), now))
            add(decide(state, Schedule(node=node), now))
            add(decide(state, ReportRelease(pod=pod, node=node, reason="completed"), now))
    return envelopes


class Counted:
    """The log as the executor's loop reads it, counting its consumer's deliveries."""

    def __init__(self, inner: JetStreamEventLog) -> None:
        self._inner = inner
        self.deliveries = 0
        self.set_aside = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def append(self, envelope: Envelope, **expectations: Any) -> int:
        """The loop's only own append here: an entry it set aside (the bench reacts with none)."""
        self.set_aside += 1
        return await self._inner.append(envelope, **expectations)

    def subscribe(self, **options: Any) -> Any:
        inner = self._inner.subscribe(**options)
        outer = self

        class Subscription:
            def __aiter__(self) -> Subscription:
                return self

            async def __anext__(self) -> Any:
                delivery = await inner.__anext__()
                outer.deliveries += 1
                return delivery

            def take_ready(self, limit: int) -> list[Any]:
                taken = inner.take_ready(limit)
                outer.deliveries += len(taken)
                return taken

            async def ack_many(self, deliveries: list[Any], **options: Any) -> None:
                await inner.ack_many(deliveries, **options)  # one write, as the service's own

            async def aclose(self) -> None:
                await inner.aclose()

        return Subscription()


async def consume(url: str, stream: str, prefix: str, *, partition: bool, end: int) -> Counter[str]:
    """One executor of node 0 consuming the stream: deliveries, CPU seconds."""
    node = node_name(0)
    log = await JetStreamEventLog.connect(
        url, stream=stream, subject_prefix=prefix, writer="node-executor"
    )
    counted = Counted(log)
    loop = DeciderLoop(
        counted,  # type: ignore[arg-type]
        service="node-executor",
        partition=node if partition else None,
    )
    done = asyncio.Event()
    woken: Counter[str] = Counter()

    async def react(entry: StoredEvent) -> None:  # what NodeExecutor.react does first
        if entry.envelope.event.node == node:
            woken["own"] += 1
        if entry.seq >= end:
            done.set()

    cpu = time.process_time()
    task = asyncio.create_task(loop.consume(f"bench-{uuid.uuid4().hex[:8]}", react))
    await done.wait()
    woken["cpu_us"] = int((time.process_time() - cpu) * 1e6)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await log.close()
    woken["deliveries"] = counted.deliveries
    if counted.set_aside:
        # the figures would be those of refusing the traffic, not of reading it
        raise SystemExit(f"bench_executor: the executor set {counted.set_aside} entries aside")
    return woken


async def run(nodes_list: list[int], placements: int) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        async with run_nats_server(Path(tmp)) as url:
            for nodes in nodes_list:
                token = uuid.uuid4().hex[:8]
                stream, prefix = f"BENCH_{token}", f"bench_{token}.log"
                # the traffic of every service, written under the default writer token
                # (believed from anyone, as tools' and tests' entries are): under one
                # service's token the others' events would be refused and set aside
                writer = await JetStreamEventLog.connect(url, stream=stream, subject_prefix=prefix)
                envelopes = traffic(nodes, placements)
                seqs: list[int] = []
                for start in range(0, len(envelopes), 1000):
                    seqs += await writer.append_many(envelopes[start : start + 1000])
                own_end = max(
                    seq
                    for seq, envelope in zip(seqs, envelopes, strict=True)
                    if envelope.event.node == node_name(0)
                )
                await writer.close()
                for partition in (True, False):
                    end = own_end if partition else seqs[-1]
                    figures = await consume(url, stream, prefix, partition=partition, end=end)
                    rows.append((nodes, partition, len(envelopes), figures))
    print(
        f"node-executor consuming the log, {placements} placements per node "
        "(PodReady, Assigned, Released each)"
    )
    header = (
        "| nodes of traffic | reads | log entries | deliveries | deliveries / own placement "
        "| CPU µs / own placement | whole log ÷ partition (CPU) |"
    )
    print(header)
    print("|---|---|---|---|---|---|---|")
    by_key = {(nodes, partition): figures for nodes, partition, _, figures in rows}
    for nodes, partition, entries, figures in rows:
        per = figures["cpu_us"] / placements
        ratio = ""
        if not partition:
            own = by_key[(nodes, True)]["cpu_us"]
            ratio = f"{figures['cpu_us'] / own:.1f}×" if own else "n/a"
        print(
            f"| {nodes} | {'its node' if partition else 'whole log'} | {entries:,} "
            f"| {figures['deliveries']:,} | {figures['deliveries'] / placements:.1f} "
            f"| {per:,.0f} | {ratio} |"
        )


def guard_round(commands: int = 16, rounds: int = 50) -> None:
    """The memory guard's per-round cost of knowing each command's processes."""
    import os
    import subprocess
    import sys

    from gpupool.node_executor.processes import group_members, leader_exited, process_groups

    script = "import os, time\nif os.fork() == 0:\n    time.sleep(600)\ntime.sleep(600)\n"
    leaders = [
        subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
        for _ in range(commands)
    ]
    try:
        while any(len(group_members(p.pid)) < 2 for p in leaders):
            time.sleep(0.05)  # the children are forking: wait until each group has two
        sampled = [pid for p in leaders for pid in group_members(p.pid)]
        running = sum(1 for entry in os.listdir("/proc") if entry.isdigit())
        start = time.process_time()
        for _ in range(rounds):
            for p in leaders:
                group_members(p.pid)
        scan = (time.process_time() - start) / rounds
        start = time.process_time()
        for _ in range(rounds):
            groups = process_groups(sampled)  # once per round, as the guard does
            for p in leaders:
                leader_exited(p.pid)
                {pid for pid, ids in groups.items() if p.pid in ids}
        targeted = (time.process_time() - start) / rounds
    finally:
        for p in leaders:
            os.killpg(p.pid, 9)
            p.wait()
    print()
    print(f"memory-guard round, {commands} running commands, {running} processes on the machine")
    print("| finding each command's processes | CPU per round | ratio |")
    print("|---|---|---|")
    print(f"| before: scan /proc per command (`group_members`) | {scan * 1e3:.2f} ms | 1.0× |")
    print(
        f"| now: pidfd poll + stat of the {len(sampled)} sampled pids (`process_groups`) "
        f"| {targeted * 1e3:.2f} ms | {targeted / scan:.2f}× |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--placements", type=int, default=300)
    parser.add_argument("--nodes", default="1,16")
    args = parser.parse_args()
    asyncio.run(run([int(n) for n in args.nodes.split(",")], args.placements))
    guard_round()


if __name__ == "__main__":
    main()
