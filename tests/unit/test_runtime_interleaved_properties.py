"""Interleaved deciders on one log: no decision ever lands in part (issue 9, finding 1).

Two policy replicas register static pods on one node; between a replica's decision
and its append, another writer may append first (drawn by hypothesis), which makes
the append conflict. Whatever the interleaving:

* every static pod registered is bound in the same entry (``PodRegistered`` and its
  ``Assigned`` share one sequence): none is left dormant without its GPU;
* no GPU is bound beyond 100 % by requests;
* a rebuild from zero equals each replica's state.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpupool.core import RegisterPod, RemovePod
from gpupool.core.validation import (
    COMPUTE_CLASS_LABEL,
    CORE_RESOURCE,
    MEMORY_RESOURCE,
    POLICY_LABEL,
    ContainerResources,
    PodManifest,
)
from gpupool.eventlog import InMemoryEventLog, StoredEvent
from gpupool.eventlog.port import DecisionAppend, append_each
from gpupool.events import (
    Assigned,
    Envelope,
    Event,
    GpuInfo,
    GpuInventoryReported,
    NodeConfigured,
    PodRef,
    PodRegistered,
)
from gpupool.runtime.decider import DeciderLoop
from gpupool.runtime.projection import Projection

NODE = "n"
T0 = datetime(2025, 4, 22, 8, 0, 0, tzinfo=UTC)


def manifest(name: str, request: int) -> PodManifest:
    return PodManifest(
        namespace="default",
        name=name,
        node=NODE,
        uid=f"uid-{name}",
        labels={COMPUTE_CLASS_LABEL: "gpu-hpn", POLICY_LABEL: "static"},
        containers=(
            ContainerResources(
                name="main",
                requests={CORE_RESOURCE: request, MEMORY_RESOURCE: request},
                limits={CORE_RESOURCE: 100, MEMORY_RESOURCE: 100},
            ),
        ),
    )


class Interleaving:
    """The log, where another writer's command may run just before a decision is appended."""

    def __init__(self, inner: InMemoryEventLog, cuts: list[bool]) -> None:
        self.inner = inner
        self.cuts = cuts
        self.interloper: DeciderLoop | None = None
        self.pending: list[RegisterPod | RemovePod] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    async def append_decision(
        self,
        envelopes: Sequence[Envelope],
        *,
        expected_node_seq: int | None = None,
        expected_writer: str | None = None,
    ) -> int:
        if self.cuts and self.cuts.pop() and self.pending and self.interloper is not None:
            command = self.pending.pop()
            await self.interloper.rebuild()
            await self.interloper.execute(command, node=NODE)
        return await self.inner.append_decision(
            envelopes, expected_node_seq=expected_node_seq, expected_writer=expected_writer
        )

    async def append_decisions(self, decisions: Sequence[DecisionAppend]) -> list[int | Exception]:
        return await append_each(self, decisions)  # type: ignore[arg-type]  # through the above


async def scenario(requests: list[int], cuts: list[bool], removals: list[int]) -> None:
    log = InMemoryEventLog()
    for event in (
        GpuInventoryReported(
            node=NODE,
            gpus=tuple(GpuInfo(index=i, uuid=f"GPU-{i}", memory_mib=81920) for i in range(2)),
            source="simulated",
        ),
        NodeConfigured(node=NODE, policy="static", gpu_count=2),
    ):
        await log.append(Envelope(id=uuid.uuid4().hex, time=T0, event=event))
    wrapped = Interleaving(log, list(cuts))
    first = DeciderLoop(wrapped, service="policy-0")  # type: ignore[arg-type]
    second = DeciderLoop(log, service="policy-1")
    wrapped.interloper = second
    for loop in (first, second):
        await loop.rebuild()
    names = [f"pod-{i}" for i in range(len(requests))]
    # the other replica registers the odd pods (and removes some), in between
    wrapped.pending = [
        RegisterPod(manifest=manifest(name, request))
        for name, request in zip(names[1::2], requests[1::2], strict=True)
    ] + [
        RemovePod(pod=PodRef(namespace="default", name=names[i % len(names)]), node=NODE)
        for i in removals
    ]
    for name, request in zip(names[::2], requests[::2], strict=True):
        await first.rebuild()
        await first.execute(RegisterPod(manifest=manifest(name, request)), node=NODE)
    for command in list(wrapped.pending):
        await second.rebuild()
        await second.execute(command, node=NODE)
    entries = [entry async for entry in log.replay()]
    by_seq: dict[int, list[Event]] = {}
    for entry in entries:
        assert isinstance(entry, StoredEvent)
        by_seq.setdefault(entry.seq, []).append(entry.envelope.event)
    for events in by_seq.values():
        for event in events:
            if isinstance(event, PodRegistered):
                assert any(
                    isinstance(other, Assigned) and other.pod == event.pod for other in events
                ), f"{event.pod} registered without its GPU in the same entry: {events}"
    rebuilt = Projection()
    for entry in entries:
        assert isinstance(entry, StoredEvent)
        rebuilt.apply(entry.seq, entry.envelope, index=entry.index, last=entry.last)
    used: dict[int, int] = {}
    for pod in rebuilt.state.pods_on(NODE):
        assert pod.gpu_index is not None, f"{pod.ref} is registered without a GPU"
        used[pod.gpu_index] = used.get(pod.gpu_index, 0) + pod.requests.core
    assert all(total <= 100 for total in used.values()), used
    for loop in (first, second):
        await loop.rebuild()
        assert loop.projection.state == rebuilt.state


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    requests=st.lists(st.sampled_from([10, 30, 50, 60, 100]), min_size=2, max_size=8),
    cuts=st.lists(st.booleans(), max_size=12),
    removals=st.lists(st.integers(0, 7), max_size=3),
)
def test_interleaved_replicas_never_leave_a_decision_in_part(
    requests: list[int], cuts: list[bool], removals: list[int]
) -> None:
    asyncio.run(scenario(requests, cuts, removals))
