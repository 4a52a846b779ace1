"""Fault injection with real processes: the admission-queue or the preemption service is
SIGKILLed at seeded moments of a preemption and of a pod deletion, and restarted.

A real local stack (nats-server and the four services as processes) and real ``gpupool
run`` workloads on one GPU. low runs; high (higher priority) becomes ready and preempts
it; then next queues and high is deleted (the policy's RemovePod, decided against the
stack's log as in tests/e2e/test_cuda_hook_deletion.py: local mode has no API server).
For each phase the seed picks the service to kill and the moment: a point in the log
(high ready, low preempted; before the deletion, after PodRemoved), never a time. The
killed service is restarted as the crash-recovery test does (``stack.restart``).

Checked afterwards:

* ``verify`` (safety, liveness, optimality) passes on the whole log;
* no GPU was shared beyond 100 %: by the log (limits of the pods between Assigned and
  Released never sum past 100 on a GPU) and by the processes (when a pod's command
  starts, the command of the pod that held the GPU before it has exited);
* each killed service, restarted and then stopped, saved a state equal to a rebuild
  from zero of the log up to the sequence its snapshot covers.
"""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path

import pytest
from stack_harness import envelopes, of_type, read_log, running_stack, start_workload, wait_for_log

from gpupool.cli.audit import verify
from gpupool.core import RemovePod
from gpupool.eventlog.jetstream import JetStreamEventLog
from gpupool.eventlog.port import StoredEvent
from gpupool.events import (
    Assigned,
    Envelope,
    PodReady,
    PodRef,
    PodRegistered,
    PodRemoved,
    Preempted,
    Released,
)
from gpupool.runtime.decider import DeciderLoop
from gpupool.runtime.projection import Projection
from gpupool.runtime.snapshot import decode_snapshot
from gpupool.workload.messages import EXIT_PREEMPTED

NODE = "node-1"
CLUSTER = """
nodes:
  - name: node-1
    gpus: 1
    qos: '{"preemptEnabled": true, "preemptGracePeriodSeconds": 1}'
pods:
  - {name: low, node: node-1, priority: 0, requests: {core: 30, memory: 30}, limits: {core: 100, memory: 100}}
  - {name: high, node: node-1, priority: 10, requests: {core: 30, memory: 30}, limits: {core: 100, memory: 100}}
  - {name: next, node: node-1, priority: 0, requests: {core: 30, memory: 30}, limits: {core: 100, memory: 100}}
"""
SERVICES = ("admission-queue", "preemption")
SEEDS = [15, 5, 7, 21]
"""Between them, each service killed at each moment of each phase."""


def alive(pid: int) -> bool:
    """The process exists and has not exited (a zombie not yet reaped has exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def command_pid(line: str) -> int:
    return int(line.rsplit(" ", 1)[1])


def is_running_line(line: str) -> bool:
    return line.startswith("gpupool: running on GPU") and " as pid " in line


def overcommitted(log: list[Envelope]) -> list[str]:
    """Moments where the limits of the pods holding a GPU sum past 100 %."""
    limit = {e.event.pod: e.event.limits.core for e in of_type(log, PodRegistered)}
    memory = {e.event.pod: e.event.limits.memory for e in of_type(log, PodRegistered)}
    holding: dict[int, set[PodRef]] = defaultdict(set)
    found = []
    for envelope in log:
        event = envelope.event
        if isinstance(event, Assigned):
            holding[event.gpu_index].add(event.pod)
            pods = holding[event.gpu_index]
            if sum(limit[p] for p in pods) > 100 or sum(memory[p] for p in pods) > 100:
                found.append(f"{envelope.id}: GPU {event.gpu_index} held by {sorted(pods)}")
        elif isinstance(event, Released) and event.gpu_index is not None:
            holding[event.gpu_index].discard(event.pod)
    return found


async def remove_as_policy(url: str, pod: str) -> None:
    log = await JetStreamEventLog.connect(url)
    try:
        policy = DeciderLoop(log, service="policy")
        await policy.rebuild()
        await policy.execute(
            RemovePod(pod=PodRef(namespace="default", name=pod), node=NODE), node=NODE
        )
    finally:
        await log.close()


@pytest.mark.parametrize("seed", SEEDS)
async def test_services_killed_during_a_preemption_and_a_deletion_lose_nothing(
    tmp_path: Path, seed: int
) -> None:
    rng = random.Random(seed)
    preemption_fault = (rng.choice(SERVICES), rng.choice(["high-ready", "low-preempted"]))
    deletion_fault = (rng.choice(SERVICES), rng.choice(["before-removal", "after-removed"]))
    killed: set[str] = set()
    async with running_stack(tmp_path, CLUSTER, NODE, gpus=1) as stack:
        low = await start_workload(stack, "low")
        low_pid = command_pid(await low.until_line(is_running_line))

        # the preemption, with a service killed at the seeded point and restarted
        service, moment = preemption_fault
        high = await start_workload(stack, "high")
        if moment == "high-ready":
            await wait_for_log(stack, lambda log: bool(of_type(log, PodReady, "high")))
        else:
            await wait_for_log(stack, lambda log: bool(of_type(log, Preempted)))
        await stack.kill(service)
        killed.add(service)
        await stack.restart(service)
        high_pid = command_pid(await high.until_line(is_running_line, within=60))
        assert not alive(low_pid), "high's command started while the preempted low's still ran"
        assert await low.exit_code() == EXIT_PREEMPTED

        # the deletion of high while next waits, with a service killed at the seeded point
        service, moment = deletion_fault
        following = await start_workload(stack, "next")
        await wait_for_log(stack, lambda log: bool(of_type(log, PodReady, "next")))
        if moment == "before-removal":
            await stack.kill(service)
            await remove_as_policy(stack.nats_url, "high")
        else:
            await remove_as_policy(stack.nats_url, "high")
            await wait_for_log(stack, lambda log: bool(of_type(log, PodRemoved, "high")))
            await stack.kill(service)
        killed.add(service)
        await stack.restart(service)
        await following.until_line(is_running_line, within=60)
        assert not alive(high_pid), "next's command started while the deleted high's still ran"
        await high.exit_code()
        assert await following.finish() == 0
        await wait_for_log(stack, lambda log: bool(of_type(log, Released, "next")))

        # the restarted services, stopped: each saves the state it folded
        for name in sorted(killed):
            await stack.stop_service(name)
        entries = await read_log(stack)
        snapshots = {
            name: decode_snapshot(
                (stack.settings.state_dir / "snapshots" / f"{name}-local.snapshot").read_bytes()
            )
            for name in sorted(killed)
        }

    report = verify(entries)
    assert report.ok, report.violations[:3]
    log = envelopes(entries)
    assert overcommitted(log) == []
    assert [e.event.pod.name for e in of_type(log, Assigned)] == ["low", "high", "next"]
    assert len({e.id for e in log}) == len(log), "an event was recorded twice"
    for name, snapshot in snapshots.items():
        rebuilt = Projection()
        for entry in entries:
            if isinstance(entry, StoredEvent) and entry.seq <= snapshot.last_seq:
                rebuilt.apply(entry.seq, entry.envelope, index=entry.index, last=entry.last)
        assert Projection.from_snapshot(snapshot).state == rebuilt.state, name
        assert snapshot.last_seq >= max(
            e.seq
            for e in entries
            if isinstance(e, StoredEvent) and isinstance(e.envelope.event, Assigned)
        ), name
