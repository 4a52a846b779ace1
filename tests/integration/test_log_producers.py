"""An event from a service that does not produce it is recorded as a rejection and never
applied: on a real nats-server, through the services' own decider loop and ``verify``.

Each service appends under its own writer token (``<prefix>.<node>.<writer>``); the
preemption service never appends an ``Assigned``. Here one arrives on its subject
(what a compromised or buggy preemption service could do with its own credential):
the admission-queue's rebuild refuses it with ``WrongProducer``, records one
``MessageRejected`` for it, goes on folding and deciding, and ``verify`` reports it.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest

from gpupool.cli.audit import verify
from gpupool.core import Schedule
from gpupool.eventlog import JetStreamEventLog
from gpupool.eventlog.port import StoredEvent
from gpupool.events import (
    Assigned,
    Envelope,
    Event,
    GpuInfo,
    GpuInventoryReported,
    MessageRejected,
    NodeConfigured,
    PodReady,
    PodRef,
    PodRegistered,
    QosConfig,
    Share,
)
from gpupool.runtime.decider import DeciderLoop

pytestmark = pytest.mark.integration


NODE = "gpu-node-1"
POD = PodRef(namespace="default", name="a")
GPU = GpuInfo(index=0, uuid="GPU-0", memory_mib=81920, name="test")


def envelope(event: Event) -> Envelope:
    return Envelope(id=uuid.uuid4().hex, time=datetime(2025, 1, 1, tzinfo=UTC), event=event)


async def writer_log(nats_url: str, base: JetStreamEventLog, writer: str) -> JetStreamEventLog:
    return await JetStreamEventLog.connect(
        nats_url, stream=base.stream, subject_prefix=base.subject_prefix, writer=writer
    )


async def test_an_assigned_from_the_preemption_service_is_rejected_not_applied(
    nats_url: str, jetstream_log: JetStreamEventLog
) -> None:
    logs = {w: await writer_log(nats_url, jetstream_log, w) for w in ("policy", "node-executor",
                                                                      "preemption")}  # fmt: skip
    try:
        inventory = GpuInventoryReported(node=NODE, gpus=(GPU,), source="simulated")
        await logs["node-executor"].append(envelope(inventory))
        configured = NodeConfigured(node=NODE, policy="share-pool", qos=QosConfig(), gpu_count=1)
        await logs["policy"].append(envelope(configured))
        half = Share(core=50, memory=50)
        registered = PodRegistered(
            pod=POD, node=NODE, policy="share-pool", requests=half, limits=half, priority=0
        )
        await logs["policy"].append(envelope(registered))
        await logs["node-executor"].append(envelope(PodReady(pod=POD, node=NODE)))
        forged = await logs["preemption"].append(
            envelope(Assigned(pod=POD, node=NODE, gpu_index=0, gpu_uuid=GPU.uuid))
        )
        queue_log = await writer_log(nats_url, jetstream_log, "admission-queue")
        try:
            queue = DeciderLoop(queue_log, service="admission-queue")
            await queue.rebuild()
            assert queue.projection.state.pods[POD].phase == "ready"  # not running
            # it goes on: the admission-queue assigns the pod itself
            decided = await queue.execute(Schedule(node=NODE), node=NODE)
            assert [type(event) for event in decided] == [Assigned]
            assert queue.projection.state.pods[POD].phase == "running"
        finally:
            await queue_log.close()
        entries = [entry async for entry in jetstream_log.replay()]
        rejections = [
            entry.envelope.event
            for entry in entries
            if isinstance(entry, StoredEvent) and isinstance(entry.envelope.event, MessageRejected)
        ]
        assert [(r.seq, r.reason.split(":")[0]) for r in rejections] == [(forged, "WrongProducer")]
        # a second service rebuilding records nothing again
        again_log = await writer_log(nats_url, jetstream_log, "preemption")
        try:
            await DeciderLoop(again_log, service="preemption").rebuild()
        finally:
            await again_log.close()
        assert len([e async for e in jetstream_log.replay()]) == len(entries)
        report = verify(entries)
        assert (forged, "WrongProducer") in [
            (item.seq, item.reason.split(":")[0]) for item in report.set_aside
        ]
        assert [v.seq for v in report.violations] == [forged]
    finally:
        for log in logs.values():
            await log.close()
