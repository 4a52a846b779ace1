"""Fault injection on real JetStream: deciders killed around their commits (seeded, bounded).

Four deciders (policy, node-executor, admission-queue, preemption), each a real
DeciderLoop on its own JetStream connection, drive one share-pool node through a
seeded random workload: registrations, requests, completions, deletions (with a
grace period: the executor ends processes later), preemptions and inventory
changes. Every append may be hit by a fault that kills its decider just before
the publish (nothing lands) or just after it (the entry lands, the decider never
folds it). A killed decider is restarted from zero or from a snapshot of what it
had folded, and the workload goes on.

The executor keeps its own record of processes: a process starts when the log
says its pod runs and ends before the executor reports the release. Checked:

* at every step, no GPU is shared beyond 100 % by the limits of live processes;
* afterwards ``verify`` (safety, liveness, optimality) passes on the whole log;
* a rebuild from zero equals every decider's live state.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from gpupool.cli.audit import verify
from gpupool.core import (
    Command,
    ConfigureNode,
    PlanPreemption,
    RegisterPod,
    RemovePod,
    ReportInventory,
    ReportRelease,
    RequestGpu,
    Schedule,
)
from gpupool.core.state import State
from gpupool.core.validation import (
    COMPUTE_CLASS_LABEL,
    CORE_RESOURCE,
    MEMORY_RESOURCE,
    POLICY_LABEL,
    ContainerResources,
    PodManifest,
)
from gpupool.eventlog import JetStreamEventLog
from gpupool.eventlog.port import DecisionAppend, StoredEvent, append_each
from gpupool.events import Envelope, GpuInfo, PodRef, ReleaseReason, Share
from gpupool.runtime.decider import DeciderLoop
from gpupool.runtime.projection import Projection

pytestmark = pytest.mark.integration

NODE = "fault-node"
SEEDS = [1, 2, 4, 5]
STEPS = 250
FAULT_RATE = 0.15


class Crash(Exception):
    """The decider process died here."""


@dataclass
class Faults:
    rng: random.Random
    injected: dict[str, int] = field(default_factory=lambda: {"before": 0, "after": 0})

    def draw(self) -> str | None:
        roll = self.rng.random()
        if roll < FAULT_RATE / 2:
            return "before"
        if roll < FAULT_RATE:
            return "after"
        return None


class FaultyLog:
    """The real log, but a decision's append may kill its decider before or after the publish."""

    def __init__(self, inner: JetStreamEventLog, faults: Faults) -> None:
        self.inner = inner
        self.faults = faults

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    async def append_decision(
        self,
        envelopes: Sequence[Envelope],
        *,
        expected_node_seq: int | None = None,
        expected_writer: str | None = None,
    ) -> int:
        fault = self.faults.draw()
        if fault == "before":
            self.faults.injected["before"] += 1
            raise Crash("killed before its decision was published")
        seq = await self.inner.append_decision(
            envelopes, expected_node_seq=expected_node_seq, expected_writer=expected_writer
        )
        if fault == "after":
            self.faults.injected["after"] += 1
            raise Crash("killed after its decision was published, before folding it")
        return seq

    async def append_decisions(self, decisions: Sequence[DecisionAppend]) -> list[int | Exception]:
        return await append_each(self, decisions)  # type: ignore[arg-type]  # through the above


@dataclass
class Actor:
    service: str
    log: FaultyLog
    rng: random.Random
    loop: DeciderLoop | None = None
    restarts: int = 0

    async def start(self, snapshot: Projection | None = None) -> None:
        projection = snapshot if snapshot is not None else Projection()
        self.loop = DeciderLoop(self.log, service=self.service, projection=projection)  # type: ignore[arg-type]
        await self.loop.rebuild()

    async def run(self, command: Command) -> bool:
        """Catch up, decide and append; on a crash restart (from zero or a snapshot). True if it ran."""
        assert self.loop is not None
        await self.loop.rebuild()
        try:
            await self.loop.execute(command, node=NODE)
            return True
        except Crash:
            self.restarts += 1
            kept = None
            if self.rng.random() < 0.5:  # a snapshot of what it had folded before dying
                kept = Projection.from_snapshot(self.loop.projection.to_snapshot())
            await self.start(kept)
            return False


def manifest(name: str, limit: int, priority: int) -> PodManifest:
    return PodManifest(
        namespace="default",
        name=name,
        node=NODE,
        uid=f"uid-{name}",
        labels={COMPUTE_CLASS_LABEL: "gpu-hpn", POLICY_LABEL: "share-pool"},
        priority=priority,
        containers=(
            ContainerResources(
                name="main",
                requests={CORE_RESOURCE: 5, MEMORY_RESOURCE: 5},
                limits={CORE_RESOURCE: limit, MEMORY_RESOURCE: limit},
            ),
        ),
    )


def gpus(count: int) -> tuple[GpuInfo, ...]:
    return tuple(
        GpuInfo(index=i, uuid=f"GPU-SIMULATED-{NODE}-{i}", memory_mib=81920, name="simulated")
        for i in range(count)
    )


@dataclass
class Executor:
    """The node-executor's own record: processes live from Assigned until just before Released."""

    actor: Actor
    processes: dict[PodRef, tuple[int, Share]] = field(default_factory=dict)
    ended: set[PodRef] = field(default_factory=set)
    """Ended, release not yet committed (a crash lost it): reported again."""

    def state(self) -> State:
        assert self.actor.loop is not None
        return self.actor.loop.projection.state

    async def follow(self) -> None:
        """Start what the log says runs; end what is releasing or gone; report ends."""
        assert self.actor.loop is not None
        await self.actor.loop.rebuild()
        state = self.state()
        present = {gpu.index for gpu in state.node(NODE).gpus}
        for ref, (gpu, _) in list(self.processes.items()):
            pod = state.pods.get(ref)
            if pod is None:
                continue  # deleted: SIGTERM sent, the process lives until its grace period ends
            if pod.phase != "running" or pod.gpu_index != gpu or gpu not in present:
                del self.processes[ref]  # its GPU vanished: the process is ended
        for pod in state.pods_on(NODE):
            if (
                pod.phase == "running"
                and pod.ref not in self.processes
                and pod.ref not in self.ended
            ):
                if pod.releasing:
                    self.ended.add(pod.ref)  # nothing of it runs: report its end
                elif pod.gpu_index is not None:
                    self.processes[pod.ref] = (pod.gpu_index, pod.limits)
        for ref in sorted(self.ended):
            pod = state.pods.get(ref)
            if pod is None or pod.phase != "running":
                self.ended.discard(ref)
                continue
            reason: ReleaseReason = "preempted" if pod.evicted_by is not None else "cancelled"
            if await self.actor.run(ReportRelease(pod=ref, node=NODE, reason=reason)):
                self.ended.discard(ref)

    async def end(self, ref: PodRef) -> None:
        """The process ends (completed, or ended for a releasing pod); then its release is reported."""
        self.processes.pop(ref, None)
        self.ended.add(ref)
        await self.follow()

    async def grace_period_over(self) -> None:
        """The processes of releasing (preempted, deleted) or gone pods end now."""
        state = self.state()
        for ref in sorted(self.processes):
            pod = state.pods.get(ref)
            if pod is None or pod.releasing:
                await self.end(ref)

    def check_gpus(self) -> None:
        used: dict[int, list[int]] = {}
        for gpu, share in self.processes.values():
            total = used.setdefault(gpu, [0, 0])
            total[0] += share.core
            total[1] += share.memory
        for gpu, (core, memory) in used.items():
            assert core <= 100 and memory <= 100, (
                f"GPU {gpu} shared by live processes: {core}/{memory}"
            )


async def connect(nats_url: str, like: JetStreamEventLog) -> JetStreamEventLog:
    return await JetStreamEventLog.connect(
        nats_url, stream=like.stream, subject_prefix=like.subject_prefix
    )


@pytest.mark.parametrize("seed", SEEDS)
async def test_deciders_killed_around_their_commits_lose_nothing_and_share_no_gpu(
    jetstream_log: JetStreamEventLog, nats_url: str, seed: int
) -> None:
    rng = random.Random(seed)
    faults = Faults(random.Random(seed + 1))
    logs = [await connect(nats_url, jetstream_log) for _ in range(4)]
    try:
        policy, executor_actor, admission, preemption = (
            Actor(name, FaultyLog(log, faults), random.Random(seed + 2 + i))
            for i, (name, log) in enumerate(
                zip(["policy", "node-executor", "admission-queue", "preemption"], logs, strict=True)
            )
        )
        for actor in (policy, executor_actor, admission, preemption):
            await actor.start()
        executor = Executor(executor_actor)
        while not await executor_actor.run(
            ReportInventory(node=NODE, gpus=gpus(2), source="simulated")
        ):
            pass
        qos = '{"preemptEnabled": true}'
        while not await policy.run(
            ConfigureNode(node=NODE, policy_label="share-pool", qos_annotation=qos, gpu_count=2)
        ):
            pass
        names = [f"pod-{i}" for i in range(8)]
        for step in range(STEPS):
            name = rng.choice(names)
            ref = PodRef(namespace="default", name=name)
            kind = rng.choices(
                ["register", "ready", "complete", "delete", "inventory"], weights=[3, 5, 3, 2, 1]
            )[0]
            if kind == "register":
                await policy.run(
                    RegisterPod(
                        manifest=manifest(name, rng.choice([30, 50, 70, 100]), rng.randint(0, 2))
                    )
                )
            elif kind == "ready":
                await executor_actor.run(RequestGpu(pod=ref, node=NODE))
            elif kind == "complete" and executor.processes:
                await executor.end(rng.choice(sorted(executor.processes)))
            elif kind == "delete":
                await policy.run(RemovePod(pod=ref, node=NODE))
                await executor.follow()  # it sees the deletion: SIGTERM, the grace period runs
            elif kind == "inventory":
                await executor_actor.run(
                    ReportInventory(node=NODE, gpus=gpus(rng.choice([1, 2, 3])), source="simulated")
                )
            await admission.run(Schedule(node=NODE))
            await preemption.run(PlanPreemption(node=NODE))
            await executor.follow()
            executor.check_gpus()
            # the grace period ends now and then: the executor ends what is releasing
            if step % 3 == 0:
                await executor.grace_period_over()
                executor.check_gpus()
        # drain: end everything releasing, serve the queue, until nothing changes
        for _ in range(200):
            before = await jetstream_log.last_seq()
            await executor.grace_period_over()
            for pod in list(executor.state().pods_on(NODE)):
                if pod.releasing:
                    await executor.end(pod.ref)
            await executor.follow()
            await admission.run(Schedule(node=NODE))
            await preemption.run(PlanPreemption(node=NODE))
            await executor.follow()
            executor.check_gpus()
            if await jetstream_log.last_seq() == before:
                break
        entries = [entry async for entry in jetstream_log.replay()]
        report = verify(entries)
        assert report.violations == [], report.violations[:3]
        rebuilt = Projection()
        for entry in entries:
            assert isinstance(entry, StoredEvent), entry
            rebuilt.apply(entry.seq, entry.envelope, index=entry.index, last=entry.last)
        for actor in (policy, executor_actor, admission, preemption):
            assert actor.loop is not None
            await actor.loop.rebuild()
            assert actor.loop.projection.state == rebuilt.state, actor.service
        # the workload did what it is for: assignments, preemptions, deletions of running pods
        assert report.assignments >= 10 and report.preemptions >= 1, report
        assert sum(faults.injected.values()) >= 5, faults.injected  # the faults did happen
        assert sum(a.restarts for a in (policy, executor_actor, admission, preemption)) >= 5
    finally:
        for log in logs:
            await log.close()
