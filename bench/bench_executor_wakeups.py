"""The node-executor's CPU per event of its node, with N pods waiting in the node's queue.

    .venv/bin/python bench/bench_executor_wakeups.py [--waiting 16,256,1024] [--events 300]

A real ``NodeExecutor`` (its decider loop consuming an in-memory log, as in the tests), one
GPU held by a running pod (a real ``sleep`` under the supervisor) and N pods whose clients
asked for it: N real sessions waiting in ``_wait_for_gpu``, their clients stand-ins that
take every message. Then M events of one more pod, which has no session (its PodReady and
its Released out of the queue, in turn), are appended one at a time; after each, the bench
waits until the executor reacted to it and gives the event loop two more turns (the woken
sessions' own turn). The figure is the process's CPU per event (``time.process_time``
over the M events), beside the same with no pod waiting, measured in the same run.

Before, every event of the node woke every session; now only those the event names
(``pods_touched``), so the cost per event stays flat in N. Runs on older code too (for the
before/after). Prints a table; asserts only that the sessions were waiting.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import tempfile
import time
import uuid
from contextlib import AsyncExitStack
from datetime import UTC, datetime
from pathlib import Path

from gpupool.core import Schedule
from gpupool.eventlog import InMemoryEventLog
from gpupool.eventlog.port import StoredEvent
from gpupool.events import (
    Envelope,
    Event,
    GpuInventoryReported,
    NodeConfigured,
    PodReady,
    PodRef,
    PodRegistered,
    QosConfig,
    Released,
    Share,
)
from gpupool.gpus import simulated_inventory
from gpupool.node_executor.inventory import sampler_for
from gpupool.node_executor.peer_identity import PeerIdentity
from gpupool.node_executor.processes import ProcessSupervisor
from gpupool.node_executor.service import NodeExecutor
from gpupool.runtime.decider import DeciderLoop
from gpupool.workload import ExecutorMessage, RunRequest, Started

NODE = "bench-node"
T0 = datetime(2025, 4, 22, 8, 0, 0, tzinfo=UTC)
OTHER = PodRef(namespace="bench", name="other")


class Client:
    """The executor's side of a client connection that takes every message at once."""

    def __init__(self) -> None:
        self.peer = PeerIdentity(pid=os.getpid(), uid=os.getuid(), gid=os.getgid())
        self.started = asyncio.Event()
        self._gone = asyncio.Event()

    @property
    def client_gone(self) -> bool:
        return self._gone.is_set()

    async def wait_client_gone(self) -> None:
        await self._gone.wait()

    async def send(self, message: ExecutorMessage) -> bool:
        if isinstance(message, Started):
            self.started.set()
        return True


def pod(name: str) -> PodRef:
    return PodRef(namespace="bench", name=name)


def registered(ref: PodRef) -> PodRegistered:
    return PodRegistered(
        pod=ref,
        node=NODE,
        policy="share-pool",
        requests=Share(core=100, memory=100),
        limits=Share(core=100, memory=100),
        priority=0,
        uid=f"uid-{ref.name}",
    )


async def cpu_per_event(waiting: int, events: int, tmp: Path) -> float:
    """CPU seconds per event of another pod, with ``waiting`` sessions in the queue."""
    inventory = simulated_inventory(1, node=NODE)
    log = InMemoryEventLog()
    setup: list[Event] = [
        GpuInventoryReported(node=NODE, gpus=inventory.gpus, source="simulated"),
        NodeConfigured(node=NODE, policy="share-pool", qos=QosConfig(), gpu_count=1),
        registered(pod("holder")),
        registered(OTHER),
        *(registered(pod(f"w{i}")) for i in range(waiting)),
    ]
    for event in setup:
        await log.append(Envelope(id=uuid.uuid4().hex, time=T0, event=event))
    loop = DeciderLoop(log, service="node-executor")
    await loop.rebuild()
    executor = NodeExecutor(
        node=NODE,
        inventory=inventory,
        socket_path=tmp / f"gpupool-{waiting}.sock",
        sampler=sampler_for(inventory),
        supervisor=ProcessSupervisor(),
        message_period_seconds=3600.0,  # no waiting message during the run
    )
    reacted = 0
    reaction = asyncio.Event()

    async def react(entry: StoredEvent) -> None:
        nonlocal reacted
        await executor.react(entry)
        reacted += 1
        reaction.set()

    devnull = os.open(os.devnull, os.O_RDWR)
    tasks: list[asyncio.Task[None]] = []
    try:
        async with AsyncExitStack() as stack:
            stack.push_async_callback(log.close)
            await executor.start(loop, stack)
            tasks.append(asyncio.create_task(loop.consume("node-executor-bench", react)))
            holder = Client()
            hold = RunRequest(pod=pod("holder"), argv=["sleep", "3600"], cwd=str(tmp), env={})
            fds = (devnull, devnull, devnull)
            tasks.append(asyncio.create_task(executor.handle(hold, fds, holder)))  # type: ignore[arg-type]
            async with asyncio.timeout(30):
                while executor.loop.projection.state.pods[pod("holder")].phase != "ready":
                    await _turn()
            admission = DeciderLoop(log, service="admission-queue")
            await admission.rebuild()
            await admission.execute(Schedule(node=NODE), node=NODE)
            async with asyncio.timeout(30):
                await holder.started.wait()
            for i in range(waiting):
                request = RunRequest(pod=pod(f"w{i}"), argv=["true"], cwd=str(tmp), env={})
                tasks.append(asyncio.create_task(executor.handle(request, fds, Client())))  # type: ignore[arg-type]
            state = executor.loop.projection.state
            async with asyncio.timeout(60):
                while (
                    sum(state.pods[pod(f"w{i}")].phase == "ready" for i in range(waiting)) < waiting
                ):
                    await _turn()
            await _turns(5)
            assert len(executor.sessions) == waiting + 1, len(executor.sessions)
            start_cpu = time.process_time()
            for i in range(events):
                live: Event = (
                    PodReady(pod=OTHER, node=NODE)
                    if i % 2 == 0
                    else Released(pod=OTHER, node=NODE, reason="cancelled")
                )
                target = reacted + 1
                await log.append(Envelope(id=uuid.uuid4().hex, time=T0, event=live))
                while reacted < target:
                    reaction.clear()
                    await reaction.wait()
                await _turns(2)  # the woken sessions' turn
            cpu = time.process_time() - start_cpu
            still_waiting = sum(state.pods[pod(f"w{i}")].phase == "ready" for i in range(waiting))
            assert still_waiting == waiting, (still_waiting, waiting)
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
    finally:
        os.close(devnull)
    return cpu / events


async def _turn() -> None:
    await asyncio.sleep(0.001)  # setup only: the clients' requests and the log's appends


async def _turns(count: int) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


async def main(waiting: list[int], events: int) -> None:
    with tempfile.TemporaryDirectory(prefix="gpupool-bench-") as name:
        tmp = Path(name)
        baseline = await cpu_per_event(0, events, tmp)
        print(f"{events} events of a pod without a session, each reacted to before the next\n")
        print("| pods waiting in the queue | CPU per event (us) | x no pod waiting |")
        print("|---|---|---|")
        print(f"| 0 | {baseline * 1e6:.0f} | 1.00 |")
        for count in waiting:
            per_event = await cpu_per_event(count, events, tmp)
            print(f"| {count:,} | {per_event * 1e6:.0f} | {per_event / baseline:.2f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waiting", default="16,256,1024")
    parser.add_argument("--events", type=int, default=300)
    args = parser.parse_args()
    asyncio.run(main([int(n) for n in args.waiting.split(",")], args.events))
