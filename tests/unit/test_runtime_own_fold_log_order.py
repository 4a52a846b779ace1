"""A decider's live projection folds the log as a rebuild does, its own decisions included.

The admission-queue appends an ``Assigned`` with an expectation that covers only its own
writer's entries on the node (docs/eventlog.md, "Which entries an expectation covers"):
it lands above another writer's entry it has not seen yet (the pod removed, or its
request cancelled, just before). The decider must not fold its entry before that one: in
the log the other entry comes first, and the fold is not commutative (the Assigned of a
removed pod is a no-op in log order; folded first it puts the pod on the GPU, for good).
The live projection (state, statistics, everything a snapshot keeps) must be what a
rebuild of the same log folds (docs/eventlog.md, "An own entry is folded in log order").
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from gpupool.core import Schedule
from gpupool.eventlog import InMemoryEventLog
from gpupool.eventlog.subjects import subject_for
from gpupool.events import (
    Assigned,
    Envelope,
    Event,
    GpuInfo,
    GpuInventoryReported,
    NodeConfigured,
    PodReady,
    PodRef,
    PodRegistered,
    PodRemoved,
    QosConfig,
    Released,
    Share,
    encode_envelope,
)
from gpupool.runtime.decider import DeciderLoop
from gpupool.runtime.projection import Projection, metrics_projection

NOW = datetime(2025, 1, 1, tzinfo=UTC)
NODE = "n1"
POD = PodRef(namespace="default", name="waiting")
GPU_0 = GpuInfo(index=0, uuid="GPU-0", memory_mib=1)


async def append_as(log: InMemoryEventLog, writer: str, event: Event, at: datetime) -> int:
    envelope = Envelope(id=uuid.uuid4().hex, time=at, event=event)
    return await log.append_raw(
        subject_for(event, prefix=log.subject_prefix, writer=writer), encode_envelope(envelope)
    )


async def a_pod_waiting_for_a_gpu(log: InMemoryEventLog) -> None:
    await append_as(
        log,
        "node-executor",
        GpuInventoryReported(node=NODE, gpus=(GPU_0,), source="simulated"),
        NOW,
    )
    await append_as(
        log,
        "policy",
        NodeConfigured(node=NODE, policy="share-pool", qos=QosConfig(), gpu_count=1),
        NOW,
    )
    await append_as(
        log,
        "policy",
        PodRegistered(
            pod=POD,
            node=NODE,
            policy="share-pool",
            requests=Share(core=40, memory=40),
            limits=Share(core=40, memory=40),
            priority=0,
            uid="uid-0",
        ),
        NOW,
    )
    await append_as(log, "node-executor", PodReady(pod=POD, node=NODE), NOW)


async def deliver_the_rest(decider: DeciderLoop) -> None:
    """What the decider's consumer would deliver next: every entry past its watermark, in
    log order, folded as ``consume`` folds them (its own entries among them are skipped if
    already folded)."""
    async for entry in decider.log.replay(from_seq=decider.projection.last_seq + 1):
        decider.fold(entry)


def projection_record(projection: Projection) -> object:
    return projection.to_snapshot()


UNSEEN_ENTRIES: dict[str, tuple[str, Event]] = {
    "the pod removed": ("policy", PodRemoved(pod=POD, node=NODE)),
    "the pod's request cancelled": (
        "node-executor",
        Released(pod=POD, node=NODE, reason="cancelled", gpu_index=None),
    ),
    "the GPU gone": (
        "node-executor",
        GpuInventoryReported(node=NODE, gpus=(), source="simulated"),
    ),
}


@pytest.mark.parametrize("unseen", sorted(UNSEEN_ENTRIES))
async def test_an_own_assignment_landed_above_an_unseen_entry_folds_as_a_rebuild_does(
    unseen: str,
) -> None:
    log = InMemoryEventLog(writer="admission-queue")
    await a_pod_waiting_for_a_gpu(log)
    queue = DeciderLoop(
        log,
        service="admission-queue",
        projection=metrics_projection(),
        clock=lambda: NOW + timedelta(seconds=7),
    )
    await queue.rebuild()
    # another writer's entry on the node: stored, not delivered to the admission-queue yet
    writer, event = UNSEEN_ENTRIES[unseen]
    await append_as(log, writer, event, NOW + timedelta(seconds=3))

    [assigned] = await queue.execute(Schedule(node=NODE), node=NODE)
    assert isinstance(assigned, Assigned) and assigned.pod == POD
    # the node's next decision (the executor's entry delivered, say), then the rest delivered
    assert await queue.execute(Schedule(node=NODE), node=NODE) == []
    await deliver_the_rest(queue)

    assert not queue.projection.ahead
    rebuilt = DeciderLoop(log, service="admission-queue", projection=metrics_projection())
    await rebuilt.rebuild()
    assert queue.projection.state == rebuilt.projection.state
    assert queue.projection.statistics == rebuilt.projection.statistics
    assert projection_record(queue.projection) == projection_record(rebuilt.projection)
