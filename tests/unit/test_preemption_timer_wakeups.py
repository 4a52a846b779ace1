"""The preemption service's timer is woken by a node's events only where the node's
deadline may change (fairness preemption configured, or a deadline held): elsewhere an
event is planned for as before and costs the timer nothing."""

from __future__ import annotations

import asyncio
import uuid
from contextlib import AsyncExitStack, suppress
from datetime import UTC, datetime, timedelta

from gpupool.core import PreemptionDeadlines, State
from gpupool.eventlog import InMemoryEventLog, StoredEvent
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
    Preempted,
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


async def test_the_timer_preempts_a_pod_past_its_maximum_once_a_later_event_turns_it_on() -> None:
    """End to end through the service's timer: fairness preemption is configured only by a
    later NodeConfigured; the pod then still has a second to run, so the event's own plan
    preempts nothing and the timer's wake-up (a plan without a cause) must."""
    log = InMemoryEventLog(writer="preemption")
    node = "late"
    runner, waiter = PodRef(namespace="default", name="runner"), PodRef(namespace="default", name="waiter")  # fmt: skip

    async def append(event: Event, writer: str) -> None:
        envelope = Envelope(id=uuid.uuid4().hex, time=NOW, event=event)
        await log.append_raw(
            subject_for(event, prefix=log.subject_prefix, writer=writer), encode_envelope(envelope)
        )

    *setup, _ = node_with_a_waiter(node, QosConfig())  # inventory, configuration, a pod
    for event in setup:
        await append(
            event, "node-executor" if isinstance(event, GpuInventoryReported) else "policy"
        )
    for pod in (runner, waiter):
        registered = setup[-1]
        assert isinstance(registered, PodRegistered)
        await append(
            PodRegistered(
                pod=pod,
                node=node,
                policy="share-pool",
                requests=Share(core=100, memory=100),
                limits=Share(core=100, memory=100),
                priority=0,
                uid=f"uid-{pod.name}",
            ),
            "policy",
        )
        await append(PodReady(pod=pod, node=node), "node-executor")
        if pod is runner:  # running since NOW; the waiter waits behind it
            await append(Assigned(pod=runner, node=node, gpu_index=0, gpu_uuid=f"GPU-{node}"), "admission-queue")  # fmt: skip
    now = [NOW + timedelta(seconds=59)]  # the limit below is a minute: a second left
    loop = DeciderLoop(log, service="preemption", clock=lambda: now[0])
    await loop.rebuild()
    service = PreemptionService()
    deadline_held = asyncio.Event()

    class NotedDeadlines(PreemptionDeadlines):
        def update(self, state: State, node_name: str, now: datetime) -> None:
            super().update(state, node_name, now)
            if self.earliest() is not None:
                deadline_held.set()

    service._deadlines = NotedDeadlines()
    watcher = log.subscribe(durable="watcher", from_seq=await log.last_seq() + 1)
    async with AsyncExitStack() as stack:
        await service.start(loop, stack)
        consumer = asyncio.create_task(
            loop.consume("preemption", service.react, react_batch=service.react_batch)
        )
        try:
            await append(
                NodeConfigured(
                    node=node,
                    policy="share-pool",
                    qos=QosConfig(preempt_enabled=True, pod_max_duration_minutes=1),
                    gpu_count=1,
                ),
                "policy",
            )
            async with asyncio.timeout(30):
                await deadline_held.wait()  # the timer took the change
                assert service._deadlines.earliest() == (NOW + timedelta(minutes=1), node)
                now[0] = NOW + timedelta(minutes=1, seconds=1)  # the deadline passes
                async for delivery in watcher:
                    entry = delivery.entry
                    await delivery.ack()
                    assert isinstance(entry, StoredEvent)
                    if isinstance(entry.envelope.event, Preempted):
                        break
        finally:
            consumer.cancel()
            with suppress(asyncio.CancelledError):
                await consumer
    preempted = entry.envelope.event
    assert isinstance(preempted, Preempted)
    assert (preempted.victim, preempted.preemptor, preempted.reason) == (runner, waiter, "max-duration")  # fmt: skip
    assert entry.envelope.causation_id == ""  # the timer's plan, not the configuration's
