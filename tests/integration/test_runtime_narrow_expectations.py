"""Conflicts only where a decision can be wrong (docs/eventlog.md, "Which entries an expectation covers").

On a real nats-server, each service on its own connection under its own writer token:

* the node-executor's PodReady and the admission-queue's Assigned no longer refuse
  each other (before, both carried the node-wide expectation);
* two admission-queue replicas following a burst of 10,000 PodReady on 16 nodes
  never commit a claim the log's fold has to drop: every Assigned lands on a state
  that holds every earlier claim on its GPUs, and the GPUs fill to their capacity
  exactly.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from datetime import UTC, datetime

import pytest

from gpupool.admission_queue.service import AdmissionQueue
from gpupool.core import (
    ConfigureNode,
    PodManifest,
    RegisterPod,
    ReportInventory,
    RequestGpu,
    Schedule,
    State,
    assignment_holds,
    evolve,
)
from gpupool.core.validation import (
    COMPUTE_CLASS_LABEL,
    CORE_RESOURCE,
    MEMORY_RESOURCE,
    POLICY_LABEL,
    ContainerResources,
)
from gpupool.eventlog import JetStreamEventLog, StoredEvent
from gpupool.events import (
    Assigned,
    Envelope,
    GpuInfo,
    GpuInventoryReported,
    NodeConfigured,
    PodReady,
    PodRef,
    PodRegistered,
    QosConfig,
    Share,
)
from gpupool.runtime.decider import DeciderLoop

NOW = datetime(2025, 1, 1, tzinfo=UTC)
WAIT_S = 90.0
"""Upper bound for the burst to be served; normally seconds."""


def manifest(name: str, node: str = "n1") -> PodManifest:
    return PodManifest(
        namespace="default",
        name=name,
        node=node,
        labels={COMPUTE_CLASS_LABEL: "gpu-hpn", POLICY_LABEL: "share-pool"},
        containers=(
            ContainerResources(
                name="main",
                requests={CORE_RESOURCE: 10, MEMORY_RESOURCE: 10},
                limits={CORE_RESOURCE: 60, MEMORY_RESOURCE: 60},
            ),
        ),
    )


@pytest.fixture
async def logs(
    jetstream_log: JetStreamEventLog, nats_url: str
) -> AsyncIterator[dict[str, JetStreamEventLog]]:
    """One connection per writer on the test's stream."""
    opened: dict[str, JetStreamEventLog] = {}
    for writer in ("policy", "node-executor", "admission-queue", "admission-queue-2"):
        opened[writer] = await JetStreamEventLog.connect(
            nats_url,
            stream=jetstream_log.stream,
            subject_prefix=jetstream_log.subject_prefix,
            writer=writer.removesuffix("-2"),
        )
    try:
        yield opened
    finally:
        for log in opened.values():
            await log.close()


async def test_an_executors_pod_ready_and_an_admission_queues_assigned_do_not_refuse_each_other(
    logs: dict[str, JetStreamEventLog],
) -> None:
    policy = DeciderLoop(logs["policy"], service="policy", clock=lambda: NOW)
    executor = DeciderLoop(logs["node-executor"], service="node-executor", clock=lambda: NOW)
    admission = DeciderLoop(logs["admission-queue"], service="admission-queue", clock=lambda: NOW)
    await executor.execute(
        ReportInventory(
            node="n1", gpus=(GpuInfo(index=0, uuid="GPU-0", memory_mib=1),), source="simulated"
        ),
        node="n1",
    )
    await policy.rebuild()
    await policy.execute(
        ConfigureNode(node="n1", policy_label="share-pool", gpu_count=1), node="n1"
    )
    for name in ("x", "y", "z"):
        await policy.execute(RegisterPod(manifest=manifest(name)), node="n1")
    await executor.rebuild()
    await executor.execute(
        RequestGpu(pod=PodRef(namespace="default", name="x"), node="n1"), node="n1"
    )
    await admission.rebuild()

    # the executor appends a PodReady the admission-queue has not seen, and the other way round
    await executor.execute(
        RequestGpu(pod=PodRef(namespace="default", name="y"), node="n1"), node="n1"
    )
    decided = await admission.execute(Schedule(node="n1"), node="n1")
    await executor.execute(
        RequestGpu(pod=PodRef(namespace="default", name="z"), node="n1"), node="n1"
    )

    assert [type(event) for event in decided] == [Assigned]
    assert (admission.conflicts, executor.conflicts) == (0, 0)


PODS = 10_000
NODES = 16
GPUS = 8
LIMIT = 2
"""Percent of a GPU each pod's limits take: 50 per GPU, 6,400 in all, fewer than the pods."""
CAPACITY = NODES * GPUS * (100 // LIMIT)


def node_name(index: int) -> str:
    return f"burst-{index:02d}"


def envelope(event: object) -> Envelope:
    return Envelope(id=uuid.uuid4().hex, time=NOW, event=event)  # type: ignore[arg-type]


async def test_two_admission_queue_replicas_never_double_book_under_a_burst_of_10000(
    logs: dict[str, JetStreamEventLog],
) -> None:
    share = Share(core=LIMIT, memory=LIMIT)
    setup = [
        event
        for index in range(NODES)
        for event in (
            GpuInventoryReported(
                node=node_name(index),
                gpus=tuple(
                    GpuInfo(index=gpu, uuid=f"GPU-{index}-{gpu}", memory_mib=1)
                    for gpu in range(GPUS)
                ),
                source="simulated",
            ),
            NodeConfigured(
                node=node_name(index), policy="share-pool", qos=QosConfig(), gpu_count=GPUS
            ),
        )
    ]
    pods = [PodRef(namespace="default", name=f"p{i:05d}") for i in range(PODS)]
    registrations = [
        PodRegistered(
            pod=pod,
            node=node_name(i % NODES),
            policy="share-pool",
            requests=Share(core=1, memory=1),
            limits=share,
            priority=0,
            uid=f"uid-{i}",
        )
        for i, pod in enumerate(pods)
    ]
    # each event from the service that produces it (gpupool.core.producers)
    inventories = [e for e in setup if isinstance(e, GpuInventoryReported)]
    configured = [e for e in setup if not isinstance(e, GpuInventoryReported)]
    await logs["node-executor"].append_many([envelope(e) for e in inventories])
    await logs["policy"].append_many([envelope(e) for e in configured + registrations])

    claims = [0, 0]
    """Assigned each replica's projection folded that held: it is done at CAPACITY."""
    served = asyncio.Event()

    def counter(number: int) -> Callable[[State, Envelope, int], None]:
        def count(state: State, folded: Envelope, _: int) -> None:
            event = folded.event
            if isinstance(event, Assigned) and assignment_holds(state, event):
                claims[number] += 1
                if claims == [CAPACITY, CAPACITY]:
                    served.set()

        return count

    async with AsyncExitStack() as stack:
        consumers = []
        for number, writer in enumerate(("admission-queue", "admission-queue-2")):
            loop = DeciderLoop(logs[writer], service=writer, clock=lambda: NOW)
            loop.projection.observers.append(counter(number))
            await loop.rebuild()
            service = AdmissionQueue()
            await service.start(loop, stack)
            consumers.append(
                asyncio.create_task(
                    loop.consume(
                        f"aq-{number}",
                        service.react,
                        react_batch=service.react_batch,
                        ack_before_reacting=service.ack_before_reacting,
                        react_on_arrival=service.react_on_arrival,
                    )
                )
            )
        # the burst: every pod becomes ready at once, pipelined by the node-executor
        await logs["node-executor"].append_many(
            [envelope(PodReady(pod=pod, node=node_name(i % NODES))) for i, pod in enumerate(pods)]
        )
        try:
            async with asyncio.timeout(WAIT_S):
                await served.wait()
        finally:
            for consumer in consumers:
                consumer.cancel()
            await asyncio.gather(*consumers, return_exceptions=True)

    state = State()
    held = dropped = 0
    async for entry in logs["policy"].replay():
        assert isinstance(entry, StoredEvent)
        event = entry.envelope.event
        if isinstance(event, Assigned):
            if assignment_holds(state, event):
                held += 1
            else:
                dropped += 1
        evolve(state, entry.envelope)
    assert dropped == 0, "a replica committed a claim decided on a state missing another claim"
    assert held == CAPACITY
    running = [pod for pod in state.pods.values() if pod.phase == "running"]
    assert len(running) == CAPACITY
    per_gpu: dict[tuple[str, int | None], int] = {}
    for pod in running:
        key = (pod.node, pod.gpu_index)
        per_gpu[key] = per_gpu.get(key, 0) + pod.limits.core
    assert max(per_gpu.values()) <= 100
