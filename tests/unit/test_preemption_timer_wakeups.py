"""The preemption service's timer is woken by a node's events only where the node's
deadline may change (fairness preemption configured, or a deadline held): elsewhere an
event is planned for as before and costs the timer nothing."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from gpupool.eventlog import InMemoryEventLog, StoredEvent
from gpupool.eventlog.subjects import subject_for
from gpupool.events import (
    Envelope,
    Event,
    GpuInfo,
    GpuInventoryReported,
    NodeConfigured,
    PodReady,
    PodRef,
    PodRegistered,
    QosConfig,
    Share,
    encode_envelope,
)
from gpupool.preemption.service import PreemptionService
from gpupool.runtime.decider import DeciderLoop

NOW = datetime(2025, 1, 1, tzinfo=UTC)


def node_with_a_waiter(node: str, qos: QosConfig) -> list[Event]:
    pod = PodRef(namespace="default", name=f"{node}-pod")
    return [
        GpuInventoryReported(
            node=node,
            gpus=(GpuInfo(index=0, uuid=f"GPU-{node}", memory_mib=1),),
            source="simulated",
        ),
        NodeConfigured(node=node, policy="share-pool", qos=qos, gpu_count=1),
        PodRegistered(
            pod=pod,
            node=node,
            policy="share-pool",
            requests=Share(core=1, memory=1),
            limits=Share(core=10, memory=10),
            priority=0,
            uid=f"uid-{node}",
        ),
        PodReady(pod=pod, node=node),
    ]


async def test_a_nodes_events_wake_the_timer_only_where_its_deadline_may_change() -> None:
    log = InMemoryEventLog(writer="preemption")
    stored: dict[str, list[StoredEvent]] = {}
    for node, qos in (
        ("plain", QosConfig()),
        ("fair", QosConfig(preempt_enabled=True, pod_max_duration_minutes=10)),
    ):
        for event in node_with_a_waiter(node, qos):
            writer = (
                "node-executor" if isinstance(event, GpuInventoryReported | PodReady) else "policy"
            )
            envelope = Envelope(id=uuid.uuid4().hex, time=NOW, event=event)
            subject = subject_for(event, prefix=log.subject_prefix, writer=writer)
            seq = await log.append_raw(subject, encode_envelope(envelope))
            stored.setdefault(node, []).append(
                StoredEvent(seq=seq, subject=subject, envelope=envelope)
            )
    loop = DeciderLoop(log, service="preemption", clock=lambda: NOW)
    await loop.rebuild()
    service = PreemptionService()
    service._loop = loop  # as start() sets it, without its timer task

    await service.react_batch(stored["plain"])
    assert not service._changed.is_set()
    assert service._touched == set()

    await service.react_batch(stored["fair"])
    assert service._changed.is_set()
    assert service._touched == {"fair"}

    # several nodes in one batch: each planned (concurrently), only the fair one timed
    service._changed.clear()
    service._touched.clear()
    await service.react_batch([stored["plain"][-1], stored["fair"][-1]])
    assert service._touched == {"fair"}
