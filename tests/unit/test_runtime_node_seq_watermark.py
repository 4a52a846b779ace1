"""A node-wide decision is never made on a state missing an entry of its node.

Another writer's entry on the node, stored just before a decider's own decision, may not
be delivered yet. A writer-scoped decision (the executor's ``RequestGpu``) lands then,
since its expectation covers only its writer's entries; its success proves nothing of the
others. A node-wide decision (the executor's ``ReportInventory``) that expected that own
entry's sequence would land too (it is the node's last entry) although it was decided
without the one below it. So such an own entry is left to the log to fold in order, the
node's next decision folds it (and what lies below) first, and the node's sequence moves
only with the watermark: an entry folded ahead of it (a node-wide decision's, which
proves nothing of its node lay unseen) moves it once the watermark passes
(docs/eventlog.md, "Which entries an expectation covers").
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from gpupool.core import ReportInventory, RequestGpu
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
    QosConfig,
    Released,
    Share,
    encode_envelope,
)
from gpupool.runtime.decider import DeciderLoop
from gpupool.runtime.projection import Projection

NOW = datetime(2025, 1, 1, tzinfo=UTC)
NODE = "n1"
FIRST = PodRef(namespace="default", name="first")
SECOND = PodRef(namespace="default", name="second")
GPU_0 = GpuInfo(index=0, uuid="GPU-0", memory_mib=1)
GPU_1 = GpuInfo(index=1, uuid="GPU-1", memory_mib=1)


async def append_as(log: InMemoryEventLog, writer: str, event: Event) -> int:
    envelope = Envelope(id=uuid.uuid4().hex, time=NOW, event=event)
    return await log.append_raw(
        subject_for(event, prefix=log.subject_prefix, writer=writer), encode_envelope(envelope)
    )


async def a_share_pool_node_with_two_pods(log: InMemoryEventLog) -> None:
    """Two GPUs; the first pod waits for one, the second is registered."""
    await append_as(
        log,
        "node-executor",
        GpuInventoryReported(node=NODE, gpus=(GPU_0, GPU_1), source="simulated"),
    )
    await append_as(
        log, "policy", NodeConfigured(node=NODE, policy="share-pool", qos=QosConfig(), gpu_count=2)
    )
    for number, pod in enumerate((FIRST, SECOND)):
        await append_as(
            log,
            "policy",
            PodRegistered(
                pod=pod,
                node=NODE,
                policy="share-pool",
                requests=Share(core=40, memory=40),
                limits=Share(core=40, memory=40),
                priority=0,
                uid=f"uid-{number}",
            ),
        )
    await append_as(log, "node-executor", PodReady(pod=FIRST, node=NODE))


async def test_a_node_wide_decision_after_an_own_entry_folded_ahead_sees_the_entry_below_it() -> (
    None
):
    log = InMemoryEventLog(writer="node-executor")
    await a_share_pool_node_with_two_pods(log)
    executor = DeciderLoop(log, service="node-executor", clock=lambda: NOW)
    await executor.rebuild()
    # the admission-queue gives the first pod GPU 0: stored, not delivered to the executor
    unseen = await append_as(
        log, "admission-queue", Assigned(pod=FIRST, node=NODE, gpu_index=0, gpu_uuid="GPU-0")
    )
    # the second pod's client asks for a GPU: a writer-scoped decision, it lands above it
    [ready] = await executor.execute(RequestGpu(pod=SECOND, node=NODE), node=NODE)
    assert isinstance(ready, PodReady)
    projection = executor.projection
    assert projection.last_seq == unseen - 1 and not projection.ahead  # left to the log
    assert projection.expected_node_seq(NODE) == unseen - 1  # not past the unfolded entry

    # GPU 0 vanishes: a node-wide decision, made once the first pod's Assigned is folded
    decided = await executor.execute(
        ReportInventory(node=NODE, gpus=(GPU_1,), source="simulated"), node=NODE
    )

    assert executor.conflicts == 0 and executor.catch_up_replays == 1
    assert [type(event) for event in decided] == [GpuInventoryReported, Released]
    released = decided[1]
    assert isinstance(released, Released)
    assert (released.pod, released.reason, released.gpu_index) == (FIRST, "gpu-vanished", 0)
    assert projection.last_seq == unseen + 2 and not projection.ahead
    assert projection.expected_node_seq(NODE) == unseen + 2
    rebuilt = DeciderLoop(log, service="node-executor")
    await rebuilt.rebuild()
    assert projection.state == rebuilt.projection.state
    assert projection.node_seq == rebuilt.projection.node_seq


async def test_an_own_node_wide_decision_folded_ahead_moves_the_nodes_sequence_at_once() -> None:
    """Its success proves no entry of the node lay unseen below it: the next node-wide
    decision on the node expects it, and lands without a conflict."""
    log = InMemoryEventLog(writer="node-executor")
    await a_share_pool_node_with_two_pods(log)
    executor = DeciderLoop(log, service="node-executor", clock=lambda: NOW)
    await executor.rebuild()
    elsewhere = await append_as(
        log, "policy", NodeConfigured(node="n2", policy="share-pool", qos=QosConfig(), gpu_count=1)
    )  # another node's entry, not delivered
    await executor.execute(ReportInventory(node=NODE, gpus=(GPU_1,), source="simulated"), node=NODE)
    projection = executor.projection
    assert projection.last_seq == elsewhere - 1 and projection.ahead == {elsewhere + 1}
    assert projection.expected_node_seq(NODE) == elsewhere + 1

    decided = await executor.execute(
        ReportInventory(node=NODE, gpus=(GPU_0, GPU_1), source="simulated"), node=NODE
    )

    assert [type(event) for event in decided] == [GpuInventoryReported]
    assert executor.conflicts == 0 and executor.catch_up_replays == 0


def envelope_of(event: Event) -> Envelope:
    return Envelope(id=uuid.uuid4().hex, time=NOW, event=event)


def test_a_node_sequence_folded_ahead_moves_when_the_watermark_passes_it() -> None:
    """In order (``apply``), or passed by a partitioned reader's proof (``pass_below``)."""
    for passing in ("in order", "pass_below"):
        projection = Projection()
        projection.apply(1, envelope_of(PodReady(pod=FIRST, node="n2")), writer="node-executor")
        projection.apply(3, envelope_of(PodReady(pod=FIRST, node=NODE)), writer="node-executor")
        assert projection.ahead == {3} and projection.ahead_nodes == {3: NODE}
        assert projection.expected_node_seq(NODE, "node-executor") == 3
        assert projection.expected_node_seq(NODE) == 0
        if passing == "in order":
            projection.apply(2, envelope_of(PodReady(pod=SECOND, node="n2")), writer="policy")
        else:
            projection.pass_below(4)
        assert projection.last_seq == 3 and not projection.ahead and not projection.ahead_nodes
        assert projection.expected_node_seq(NODE) == 3, passing
