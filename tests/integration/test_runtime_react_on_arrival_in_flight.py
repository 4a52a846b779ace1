"""Batches taken in the reader's step (``DeciderLoop.consume(react_on_arrival=True)``) while
something else is in flight (docs/eventlog.md, "Deciding in the reader's step"), on a real
nats-server, the admission-queue's own path where it decides:

* a conflict refusing a decision of such a batch is caught up from the next batch the
  reader's step takes (no replay): nothing lost, nothing decided twice, the state a
  rebuild from zero folds;
* a reaction that waits for its own conflict's catch-up fails at once with
  ``ReactionWaitsOnArrival`` (it would stall the catch-up: only reactions that wait for
  none of their decisions may react on arrival);
* a stop with such a batch in flight ends it, and its deliveries go to the next instance,
  decided there once;
* a burst arriving while the consumer is held, in chunks each received before the next,
  is folded in at most two batches (not one per chunk) and its nodes decided in at most
  three ``append_decisions`` calls, not one per delivery.

Every wait is on a condition (a gate the test opens, an event, the server's ack floor).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from datetime import UTC, datetime
from typing import Any

import pytest
from log_streams import acked_up_to, delete_stream, unique_stream

import gpupool.eventlog.jetstream as jetstream
import gpupool.runtime.decider as decider
from gpupool.admission_queue.service import AdmissionQueue
from gpupool.core import Schedule
from gpupool.eventlog import DecisionAppend, JetStreamEventLog, StoredEvent
from gpupool.events import (
    NODELESS,
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
from gpupool.runtime.decider import DeciderLoop, ReactionWaitsOnArrival
from gpupool.runtime.projection import Projection

pytestmark = pytest.mark.integration

NOW = datetime(2025, 1, 1, tzinfo=UTC)
WAIT_S = 30.0
DURABLE = "in-flight"
WRITERS = ("policy", "node-executor", "admission-queue", "admission-queue-2")


def wrap(event: Event) -> Envelope:
    return Envelope(id=uuid.uuid4().hex, time=NOW, event=event)


def note(reason: str) -> Envelope:
    return wrap(MessageRejected(subject=NODELESS, reason=reason, payload=""))


def pod(name: str) -> PodRef:
    return PodRef(namespace="default", name=name)


@asynccontextmanager
async def logs(nats_url: str) -> AsyncIterator[dict[str, JetStreamEventLog]]:
    """One connection per writer on one fresh stream (``admission-queue-2``: the other
    replica, under the same writer token)."""
    stream, prefix = unique_stream()
    opened: dict[str, JetStreamEventLog] = {}
    try:
        for writer in WRITERS:
            opened[writer] = await JetStreamEventLog.connect(
                nats_url, stream=stream, subject_prefix=prefix, writer=writer.removesuffix("-2")
            )
        yield opened
    finally:
        for log in opened.values():
            await log.close()
        await delete_stream(nats_url, stream)


async def cluster(logs: dict[str, JetStreamEventLog], pods: dict[str, list[str]]) -> None:
    """Each node one GPU and its pods registered (20 % of the GPU each), by their producers."""
    for node, names in pods.items():
        gpus = (GpuInfo(index=0, uuid=f"GPU-{node}", memory_mib=1),)
        await logs["node-executor"].append(
            wrap(GpuInventoryReported(node=node, gpus=gpus, source="simulated"))
        )
        await logs["policy"].append_many(
            [
                wrap(NodeConfigured(node=node, policy="share-pool", qos=QosConfig(), gpu_count=1)),
                *(
                    wrap(
                        PodRegistered(
                            pod=pod(name),
                            node=node,
                            policy="share-pool",
                            requests=Share(core=20, memory=20),
                            limits=Share(core=20, memory=20),
                            priority=0,
                            uid=f"uid-{name}",
                        )
                    )
                    for name in names
                ),
            ]
        )


async def ready(logs: dict[str, JetStreamEventLog], node: str, *names: str) -> list[int]:
    return await logs["node-executor"].append_many(
        [wrap(PodReady(pod=pod(name), node=node)) for name in names]
    )


async def assignments(log: JetStreamEventLog) -> list[PodRef]:
    return [
        entry.envelope.event.pod
        async for entry in log.replay()
        if isinstance(entry, StoredEvent) and isinstance(entry.envelope.event, Assigned)
    ]


async def seqs_of(log: JetStreamEventLog, kind: type[Event]) -> AsyncIterator[int]:
    async for entry in log.replay():
        if isinstance(entry, StoredEvent) and isinstance(entry.envelope.event, kind):
            yield entry.seq


async def same_as_a_rebuild_from_zero(loop: DeciderLoop, log: JetStreamEventLog) -> None:
    rebuilt = DeciderLoop(log, service="rebuilt", clock=lambda: NOW)
    await rebuilt.rebuild()
    assert rebuilt.projection.last_seq == loop.projection.last_seq
    assert loop.projection.state == rebuilt.projection.state


class Admission:
    """The admission-queue (pipelined, reacting on arrival) on its own loop, with each batch
    it reacts to recorded: its sequences, and whether the reader's step took it (the
    consumer's iterator still waits then)."""

    def __init__(self, log: JetStreamEventLog) -> None:
        self.loop = DeciderLoop(log, service="admission-queue", clock=lambda: NOW)
        self.service = AdmissionQueue()
        self.batches: list[tuple[list[int], bool]] = []
        self.before_reacting: Callable[[list[StoredEvent]], Awaitable[None]] | None = None
        """Awaited before the service reacts to a batch (a test's gate), where set."""
        self.folded = asyncio.Event()
        """Set on each event folded."""
        self.loop.projection.observers.append(lambda *_: self.folded.set())

    async def react_batch(self, entries: list[StoredEvent]) -> None:
        subscription = self.loop._subscription
        assert isinstance(subscription, jetstream.JetStreamSubscription)
        self.batches.append(([entry.seq for entry in entries], subscription._waiting))
        if self.before_reacting is not None:
            await self.before_reacting(entries)
        await self.service.react_batch(entries)

    async def started(self, stack: AsyncExitStack) -> asyncio.Task[None]:
        await self.service.start(self.loop, stack)
        consumer = asyncio.create_task(
            self.loop.consume(
                DURABLE,
                self.service.react,
                react_batch=self.react_batch,
                ack_before_reacting=self.service.ack_before_reacting,
                react_on_arrival=True,
            )
        )
        stack.push_async_callback(stopped, consumer)
        return consumer

    async def running(self, names: Sequence[str], log: JetStreamEventLog) -> None:
        """Until ``names`` run in the folded state, nothing is in flight, and every entry of
        the log is folded."""
        pods = self.loop.projection.state.pods
        async with asyncio.timeout(WAIT_S):
            while True:
                self.folded.clear()
                if all(pod(name) in pods and pods[pod(name)].phase == "running" for name in names):
                    await self.service.settled()
                    if self.loop.projection.last_seq >= await log.last_seq():
                        return
                await self.folded.wait()  # set meanwhile, if anything was folded


async def stopped(consumer: asyncio.Task[None]) -> None:
    consumer.cancel()
    await asyncio.gather(consumer, return_exceptions=True)


def entry_delivered_once_the_gate_opens(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Every pull but the first waits for the returned gate (the server holds the next
    entries back as if it were slow, or they went to another subscriber of the durable)."""
    gate = asyncio.Event()
    pulls = 0
    pull = jetstream.JetStreamSubscription._pull

    async def gated_pull(self: jetstream.JetStreamSubscription) -> None:
        nonlocal pulls
        pulls += 1
        if pulls > 1:
            await gate.wait()
        await pull(self)

    monkeypatch.setattr(jetstream.JetStreamSubscription, "_pull", gated_pull)
    return gate


def catch_ups_watched(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Set once a conflict's catch-up from the consumer has begun (and waits, if it must)."""
    began = asyncio.Event()
    catch_up = DeciderLoop._catch_up_from_consumer

    async def watched(self: DeciderLoop, actual: int | None) -> bool:
        began.set()
        return await catch_up(self, actual)

    monkeypatch.setattr(DeciderLoop, "_catch_up_from_consumer", watched)
    return began


async def test_a_conflict_of_a_batch_taken_in_the_readers_step_is_caught_up_from_the_next_one(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(jetstream, "PULL_BATCH", 2)  # the first pull: the two PodReady only
    monkeypatch.setattr(decider, "CATCH_UP_WAIT_S", 10 * WAIT_S)  # it waits for the gate
    gate = entry_delivered_once_the_gate_opens(monkeypatch)
    catching_up = catch_ups_watched(monkeypatch)
    async with logs(nats_url) as opened, AsyncExitStack() as stack:
        await cluster(opened, {"n1": ["x1"], "n2": ["x2", "y2"]})
        a = Admission(opened["admission-queue"])
        await a.loop.rebuild()
        await ready(opened, "n1", "x1")
        await ready(opened, "n2", "x2")
        b = DeciderLoop(opened["admission-queue-2"], service="admission-queue", clock=lambda: NOW)
        await b.rebuild()
        assert await b.execute(Schedule(node="n2"), node="n2")  # the other replica: x2
        [refusing] = [seq async for seq in seqs_of(opened["policy"], Assigned)]

        await a.started(stack)
        # A's batch decides x2 too, on a state without B's claim: refused; the catch-up
        # waits for A's consumer, whose next pull is held back until the gate opens
        async with asyncio.timeout(WAIT_S):
            await catching_up.wait()
        assert a.loop.conflicts == 1
        assert not a.loop._folded(refusing)
        gate.set()
        await a.running(["x1", "x2"], opened["policy"])
        await ready(opened, "n2", "y2")  # nothing lost after it: the next one is decided
        await a.running(["x1", "x2", "y2"], opened["policy"])

        assert (a.loop.conflicts, a.loop.catch_ups_from_consumer) == (1, 1)
        assert a.loop.catch_up_replays == 0
        assert a.loop.conflicts_folded_since == 0
        taken_in_readers_step = [waiting for seqs, waiting in a.batches if refusing in seqs]
        assert taken_in_readers_step == [True]  # the refusing entry: reacted to once, there
        assigned = await assignments(opened["policy"])
        assert sorted(assigned) == [pod("x1"), pod("x2"), pod("y2")]  # each once
        await same_as_a_rebuild_from_zero(a.loop, opened["policy"])
        await acked_up_to(
            opened["admission-queue"], DURABLE, await opened["policy"].last_seq(), within_s=WAIT_S
        )


async def decided(loop: DeciderLoop, node: str) -> None:
    await loop.execute(Schedule(node=node), node=node)


WAITING_REACTIONS: dict[str, Callable[[DeciderLoop, str], Awaitable[object]]] = {
    "in the batch's own task": decided,
    "through a task it awaits": lambda loop, node: asyncio.ensure_future(decided(loop, node)),
    "through a gather it awaits": lambda loop, node: asyncio.gather(decided(loop, node)),
    "through a background decision it awaits": lambda loop, node: loop.background(
        decided(loop, node), name=f"schedule {node}"
    ),
}
IN_THE_BACKGROUND = {"through a background decision it awaits"}
"""Raised in a background decision: the service fails (``DeciderLoop.failed``); the batch,
its wait over, goes on, and consume with it."""


@pytest.mark.parametrize("how", list(WAITING_REACTIONS))
async def test_a_reaction_on_arrival_that_waits_for_its_conflicts_catch_up_fails_at_once(
    nats_url: str, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    monkeypatch.setattr(jetstream, "PULL_BATCH", 1)  # the first pull: the PodReady only
    # without the check the catch-up would wait this long (consume cannot fold meanwhile)
    monkeypatch.setattr(decider, "CATCH_UP_WAIT_S", 10 * WAIT_S)
    waits = WAITING_REACTIONS[how]
    async with logs(nats_url) as opened:
        await cluster(opened, {"n1": ["x1"]})
        loop = DeciderLoop(opened["admission-queue"], service="admission-queue", clock=lambda: NOW)
        await loop.rebuild()
        await ready(opened, "n1", "x1")
        b = DeciderLoop(opened["admission-queue-2"], service="admission-queue", clock=lambda: NOW)
        await b.rebuild()
        assert await b.execute(Schedule(node="n1"), node="n1")

        async def react(entry: StoredEvent) -> None:
            raise AssertionError("a batch reaction was given")

        async def react_batch(entries: list[StoredEvent]) -> None:
            for entry in entries:
                await waits(loop, entry.envelope.event.node)  # waits for its decision

        consumer = asyncio.create_task(
            loop.consume(DURABLE, react, react_batch=react_batch, react_on_arrival=True)
        )
        try:
            if how in IN_THE_BACKGROUND:
                async with asyncio.timeout(WAIT_S):
                    await loop.failed.wait()
                assert isinstance(loop.failure, ReactionWaitsOnArrival)
                assert "waits for the catch-up" in str(loop.failure)
                assert not consumer.done()
            else:
                with pytest.raises(ReactionWaitsOnArrival, match="waits for the catch-up"):
                    async with asyncio.timeout(WAIT_S):
                        await consumer
                assert loop.failure is None
        finally:
            await stopped(consumer)
        assert loop.conflicts == 1
        assert loop.catch_up_replays == 0 and loop.catch_ups_from_consumer == 0
        assert not loop._arrival_batches
        assert await assignments(opened["policy"]) == [pod("x1")]  # B's only


async def test_the_admission_queue_not_pipelined_reacting_on_arrival_fails_at_its_first_conflict(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its batch reaction awaits its decisions (``settled``): the batch task awaits a gather
    of the batch's decision task, which starts the refused node's own task eagerly, whose
    catch-up begins within that step, before the batch awaits it (``settled`` gathers it
    only once the batch's task ended). The catch-up looks again while it waits: refused,
    not a stall until ``CATCH_UP_WAIT_S``."""
    monkeypatch.setattr(jetstream, "PULL_BATCH", 1)  # the first pull: the PodReady only
    monkeypatch.setattr(decider, "CATCH_UP_WAIT_S", 10 * WAIT_S)  # a stall outlasts the test
    async with logs(nats_url) as opened, AsyncExitStack() as stack:
        await cluster(opened, {"n1": ["x1"]})
        loop = DeciderLoop(opened["admission-queue"], service="admission-queue", clock=lambda: NOW)
        await loop.rebuild()
        await ready(opened, "n1", "x1")
        b = DeciderLoop(opened["admission-queue-2"], service="admission-queue", clock=lambda: NOW)
        await b.rebuild()
        assert await b.execute(Schedule(node="n1"), node="n1")  # the other replica: x1

        service = AdmissionQueue(pipelined=False)
        assert not service.react_on_arrival  # what the runner would pass; this test forces it
        await service.start(loop, stack)  # nothing ready in its state yet: nothing decided
        consumer = asyncio.create_task(
            loop.consume(
                DURABLE,
                service.react,
                react_batch=service.react_batch,
                ack_before_reacting=service.ack_before_reacting,
                react_on_arrival=True,
            )
        )
        stack.push_async_callback(stopped, consumer)
        async with asyncio.timeout(WAIT_S):
            await loop.failed.wait()  # the refused node's own decision: a background one
        assert isinstance(loop.failure, ReactionWaitsOnArrival)
        assert loop.conflicts == 1
        assert loop.catch_up_replays == 0 and loop.catch_ups_from_consumer == 0
        assert await assignments(opened["policy"]) == [pod("x1")]  # B's only


STOPS = ["the consumer cancelled, then the log closed", "the log closed, then the consumer"]


@pytest.mark.parametrize("stop", STOPS)
async def test_a_stop_with_a_batch_of_the_readers_step_in_flight_ends_it_and_the_next_instance_decides_its_deliveries_once(
    nats_url: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    stop: str,
) -> None:
    received = 0
    enough = asyncio.Event()
    wanted = 0
    on_raw = jetstream.JetStreamSubscription._on_raw

    def counted(
        self: jetstream.JetStreamSubscription,
        subject: bytes,
        reply: bytes,
        data: bytes,
        headers: bytes | None,
    ) -> None:
        nonlocal received
        on_raw(self, subject, reply, data, headers)
        if reply.startswith(b"$JS.ACK"):
            received += 1
            if received >= wanted:
                enough.set()

    monkeypatch.setattr(jetstream.JetStreamSubscription, "_on_raw", counted)
    unhandled: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, context: unhandled.append(context))
    caplog.set_level(logging.ERROR)
    async with logs(nats_url) as opened:
        log, writer = opened["admission-queue"], opened["policy"]
        loop = DeciderLoop(log, service="first", clock=lambda: NOW)
        await loop.rebuild()
        reacted: list[int] = []
        changed = asyncio.Event()
        held = asyncio.Event()
        never = asyncio.Event()

        async def react(entry: StoredEvent) -> None:
            raise AssertionError("a batch reaction was given")

        async def react_batch(entries: list[StoredEvent]) -> None:
            if any(getattr(e.envelope.event, "reason", "") == "held" for e in entries):
                held.set()
                await never.wait()  # in flight until the stop
            reacted.extend(entry.seq for entry in entries)
            changed.set()

        consumer = asyncio.create_task(
            loop.consume(DURABLE, react, react_batch=react_batch, react_on_arrival=True)
        )
        first = await writer.append(note("first"))
        async with asyncio.timeout(WAIT_S):
            while reacted != [first]:
                changed.clear()
                await changed.wait()
        await acked_up_to(log, DURABLE, first, within_s=WAIT_S)
        resumed_from = loop.projection.to_snapshot()  # the next instance's snapshot
        wanted = received + 6
        enough.clear()
        in_flight = [await writer.append(note("held"))]
        async with asyncio.timeout(WAIT_S):
            await held.wait()
        [batch] = loop._arrival_batches  # taken in the reader's step, gone on as a task
        in_flight += await writer.append_many([note(f"after {i}") for i in range(5)])
        async with asyncio.timeout(WAIT_S):
            await enough.wait()  # every one received: held by the batch, consume or its inbox

        async with asyncio.timeout(WAIT_S):
            if stop == STOPS[0]:
                await stopped(consumer)
                await log.close()
            else:
                await log.close()
                await stopped(consumer)
        assert consumer.done() and batch.cancelled()
        assert not loop._arrival_batches and not loop.ready
        assert reacted == [first]

        # the next instance, from the snapshot: the durable hands it what the first held
        nxt = await JetStreamEventLog.connect(
            nats_url, stream=log.stream, subject_prefix=log.subject_prefix, writer="second"
        )
        try:
            second = DeciderLoop(
                nxt,
                service="second",
                projection=Projection.from_snapshot(resumed_from),
                clock=lambda: NOW,
            )
            redelivered: list[int] = []

            async def react_again(entries: list[StoredEvent]) -> None:
                redelivered.extend(entry.seq for entry in entries)
                changed.set()

            again = asyncio.create_task(
                second.consume(DURABLE, react, react_batch=react_again, react_on_arrival=True)
            )
            try:
                async with asyncio.timeout(WAIT_S):
                    while len(redelivered) < len(in_flight):
                        changed.clear()
                        await changed.wait()
                await acked_up_to(nxt, DURABLE, in_flight[-1], within_s=WAIT_S)
                # each once (the server orders its redeliveries as it likes: a whole-log
                # fold takes them in any order)
                assert sorted(redelivered) == in_flight
            finally:
                await stopped(again)
        finally:
            await nxt.close()
    gc.collect()  # a task destroyed pending, an exception never retrieved: reported now
    assert unhandled == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


BURST_NODES = [f"b{index}" for index in range(8)]
PODS_PER_NODE = 4


async def test_a_burst_arriving_while_the_consumer_is_held_is_folded_in_two_batches_and_decided_together(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    received = 0
    enough = asyncio.Event()
    wanted = 1  # the entry that holds the consumer, then each chunk of the burst in turn
    on_raw = jetstream.JetStreamSubscription._on_raw

    def counted(
        self: jetstream.JetStreamSubscription,
        subject: bytes,
        reply: bytes,
        data: bytes,
        headers: bytes | None,
    ) -> None:
        nonlocal received
        on_raw(self, subject, reply, data, headers)
        if reply.startswith(b"$JS.ACK"):
            received += 1
            if received >= wanted:
                enough.set()

    monkeypatch.setattr(jetstream.JetStreamSubscription, "_on_raw", counted)
    names = {node: [f"{node}-{i}" for i in range(PODS_PER_NODE)] for node in BURST_NODES}
    async with logs(nats_url) as opened, AsyncExitStack() as stack:
        await cluster(opened, names)
        a = Admission(opened["admission-queue"])
        await a.loop.rebuild()
        appends: list[int] = []
        append_decisions = a.loop.log.append_decisions

        async def counted_appends(decisions: Sequence[DecisionAppend]) -> list[int | Exception]:
            appends.append(len(decisions))
            return await append_decisions(decisions)

        monkeypatch.setattr(a.loop.log, "append_decisions", counted_appends)
        gate = asyncio.Event()
        held = asyncio.Event()

        async def hold_the_first(entries: list[StoredEvent]) -> None:
            if not held.is_set():
                held.set()
                await gate.wait()

        a.before_reacting = hold_the_first
        await a.started(stack)
        await opened["policy"].append(note("holds the consumer"))
        async with asyncio.timeout(WAIT_S):
            await held.wait()
        # the burst in chunks, each received before the next is appended (each its own
        # read): a reader's step that took a batch per read while the consumer is held
        # would make one batch of each
        burst: list[int] = []
        for number in range(PODS_PER_NODE):
            wanted = received + len(names)
            enough.clear()
            burst += await opened["node-executor"].append_many(
                [wrap(PodReady(pod=pod(pods[number]), node=node)) for node, pods in names.items()]
            )
            async with asyncio.timeout(WAIT_S):
                await enough.wait()  # this chunk is in this process
        assert received == 1 + len(burst) == 1 + len(BURST_NODES) * PODS_PER_NODE
        assert not appends  # nothing decided while held
        gate.set()
        await a.running([name for pods in names.values() for name in pods], opened["policy"])

        with_burst = [seqs for seqs, _ in a.batches[1:] if set(seqs) & set(burst)]
        assert len(with_burst) <= 2  # the one consume took when woken, and the rest
        assert sorted(seq for seqs in with_burst for seq in seqs if seq in burst) == burst
        assert 1 <= len(appends) <= 3  # a batch's nodes together: not one call per delivery
        assigned = await assignments(opened["policy"])
        assert sorted(assigned) == sorted(pod(name) for pods in names.values() for name in pods)
        await same_as_a_rebuild_from_zero(a.loop, opened["policy"])
