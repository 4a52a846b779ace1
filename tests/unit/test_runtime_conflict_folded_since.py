"""A conflict whose refusing entry is folded by the time it is handled costs no catch-up.

A batch's decisions learn their outcomes together (``DeciderLoop.execute_batch``); a node
refused there is decided again by its own ``execute(refused=)``, later: by then the
service's consumer may have folded the entry that refused it (the batch's other PubAcks
came after its delivery). That entry and every one before it are folded: the decision is
made again on that state, without a replay of the log, and lands once. An entry folded
only ahead of the watermark (an own append, folded on its PubAck) says nothing of those
before it: the decision catches up first.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import pytest

from gpupool.core import Schedule
from gpupool.eventlog import InMemoryEventLog, StoredEvent
from gpupool.eventlog.port import ConcurrencyConflict, Entry
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
    Share,
    encode_envelope,
)
from gpupool.runtime.decider import DeciderLoop, Refusal

NOW = datetime(2025, 1, 1, tzinfo=UTC)
NODE = "n1"
FIRST = PodRef(namespace="default", name="first")
SECOND = PodRef(namespace="default", name="second")


class ReplayCountingLog(InMemoryEventLog):
    def __init__(self) -> None:
        super().__init__(writer="admission-queue")
        self.replays = 0

    async def replay(self, *, node: str | None = None, from_seq: int = 1) -> AsyncIterator[Entry]:
        self.replays += 1
        async for entry in super().replay(node=node, from_seq=from_seq):
            yield entry


async def append_as(log: InMemoryEventLog, writer: str, event: Event) -> None:
    envelope = Envelope(id=uuid.uuid4().hex, time=NOW, event=event)
    await log.append_raw(
        subject_for(event, prefix=log.subject_prefix, writer=writer), encode_envelope(envelope)
    )


async def a_node_with_two_ready_pods(log: InMemoryEventLog) -> None:
    """One GPU; each pod takes 40 % of it (both fit)."""
    gpus = (GpuInfo(index=0, uuid="GPU-0", memory_mib=1),)
    await append_as(
        log, "node-executor", GpuInventoryReported(node=NODE, gpus=gpus, source="simulated")
    )
    await append_as(
        log, "policy", NodeConfigured(node=NODE, policy="share-pool", qos=QosConfig(), gpu_count=1)
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
                priority=number,  # the first is served first
                uid=f"uid-{number}",
            ),
        )
    await append_as(log, "node-executor", PodReady(pod=FIRST, node=NODE))


async def assigned(log: InMemoryEventLog) -> list[PodRef]:
    return [
        entry.envelope.event.pod
        async for entry in log.replay()
        if isinstance(entry, StoredEvent) and isinstance(entry.envelope.event, Assigned)
    ]


SCOPES = ["writer-scoped", "node-wide"]
"""What the refused decision's expectation covered: its writer's entries on the node (a
``Schedule``'s), or all of them (``scope`` None: a configuration's, a rejection's)."""


@pytest.mark.parametrize("scope", SCOPES)
async def test_a_conflict_whose_refusing_entry_was_folded_meanwhile_is_decided_again_without_a_replay(
    scope: str,
) -> None:
    log = ReplayCountingLog()
    await a_node_with_two_ready_pods(log)
    a = DeciderLoop(log, service="admission-queue", clock=lambda: NOW)
    b = DeciderLoop(log, service="admission-queue", clock=lambda: NOW)  # the other replica
    await a.rebuild()
    await b.rebuild()
    assert await b.execute(Schedule(node=NODE), node=NODE)  # B assigns the first pod
    # A's batch decides the same on its older state: refused by B's entry
    [(index, refused)] = await a.execute_batch([(Schedule(node=NODE), NODE, None)])
    assert index == 0 and refused is not None
    actual = refused.conflict.actual
    assert isinstance(refused.conflict, ConcurrencyConflict) and actual is not None
    assert refused.scope == "admission-queue"
    if scope == "node-wide":  # the same refusal, as a node-wide expectation's would read
        refused = Refusal(refused.conflict, None)
    # A's consumer folds B's entry (and the second pod's PodReady after it) before A's node
    # task handles the conflict
    await append_as(log, "node-executor", PodReady(pod=SECOND, node=NODE))
    entries: list[Entry] = [entry async for entry in log.replay(from_seq=a.projection.last_seq + 1)]
    for entry in entries:
        a.fold(entry)
    assert a.projection.last_seq >= actual
    replays = log.replays

    decided = await a.execute(Schedule(node=NODE), node=NODE, refused=refused)

    assert log.replays == replays  # no replay opened: nothing was missing
    assert (a.catch_up_replays, a.catch_ups_from_consumer) == (0, 0)
    assert (a.conflicts, a.conflicts_folded_since) == (1, 1)
    assert [type(event) for event in decided] == [Assigned]
    assert await assigned(log) == [FIRST, SECOND]  # each once: B's first, A's second
    rebuilt = DeciderLoop(log, service="admission-queue")
    await rebuilt.rebuild()
    assert a.projection.state == rebuilt.projection.state


async def test_a_conflict_on_an_own_append_folded_ahead_of_the_watermark_catches_up_first() -> None:
    """A node-wide decision refused by the loop's own (writer-scoped) append, landed above
    another writer's entry on the node that is not folded: deciding again without a
    catch-up would miss that entry. The own append is left to the log to fold in order
    (docs/eventlog.md, "An own entry is folded in log order"): the next decision folds it,
    and the entry below, first; the conflict is then one folded since."""
    log = ReplayCountingLog()
    await a_node_with_two_ready_pods(log)
    a = DeciderLoop(log, service="admission-queue", clock=lambda: NOW)
    await a.rebuild()
    node_wide = a.projection.expected_node_seq(NODE)  # what a node-wide decision expects
    await append_as(log, "node-executor", PodReady(pod=SECOND, node=NODE))  # not folded by A
    unfolded = a.projection.last_seq + 1
    [own] = await a.execute(Schedule(node=NODE), node=NODE)  # A's own append: the first pod
    assert isinstance(own, Assigned) and own.pod == FIRST
    own_seq = unfolded + 1
    assert a.projection.last_seq == unfolded - 1 and not a.projection.ahead
    assert not a._folded(own_seq) and not a._folded(unfolded)
    refused = Refusal(ConcurrencyConflict(node=NODE, expected=node_wide, actual=own_seq), None)
    replays = log.replays

    decided = await a.execute(Schedule(node=NODE), node=NODE, refused=refused)

    assert (a.conflicts, a.conflicts_folded_since) == (1, 1)
    assert (a.catch_up_replays, a.catch_ups_from_consumer) == (1, 0)  # no consumer: replayed
    assert log.replays == replays + 1
    assert [type(event) for event in decided] == [Assigned]  # the second pod: its PodReady
    assert a.projection.last_seq == own_seq + 1 and not a.projection.ahead  # folded first
    assert await assigned(log) == [FIRST, SECOND]
    rebuilt = DeciderLoop(log, service="admission-queue")
    await rebuilt.rebuild()
    assert a.projection.state == rebuilt.projection.state
