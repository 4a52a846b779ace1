"""The loop every service runs around the pure core: rebuild, consume, decide, append, ack.

* **rebuild**: fold the whole log (ordered replay) into a Projection; with
  ``partition=node`` (the node-executor), only that node's entries.
* **consume**: a durable subscription per service instance (each replica folds
  every entry, or every entry of its partition; the durable lets a restarted instance
  resume where it acked), in batches: everything already delivered is folded before
  the service reacts.
* **decide + append**: ``execute`` runs ``core.decide`` on the projection and
  appends the events, as ONE entry (all or nothing), with an optimistic-concurrency
  expectation on the entries that could make the decision wrong
  (:func:`expectation_writer`: one writer's subject of the node, or the whole node). If another writer (a second replica) got there first, the append
  fails with ConcurrencyConflict: the loop catches up from the log and decides
  again, so two replicas can never both commit conflicting decisions.
* **bad input**: an undecodable entry is set aside as a MessageRejected event
  naming its sequence, unless the log already holds one for it (set aside after
  the rebuild, so a rejection recorded long ago is seen first): recorded once.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from datetime import UTC, datetime
from typing import Any

from gpupool.core import Command, ReportRelease, RequestGpu, Schedule, decide
from gpupool.eventlog.port import (
    ConcurrencyConflict,
    Entry,
    EventLog,
    StoredEvent,
    Undecodable,
    rejection_envelope,
)
from gpupool.eventlog.subjects import node_of_subject, writer_of_subject
from gpupool.events import (
    NODELESS,
    Envelope,
    Event,
    MessageRejected,
    PodReady,
    Released,
    encode_envelope,
    event_node,
)
from gpupool.runtime.projection import Projection, Refused


def refusal_entry(subject: str, refused: Refused) -> Undecodable:
    """A refused envelope, set aside as an unreadable entry is (MessageRejected with the reason)."""
    return Undecodable(
        seq=refused.seq,
        subject=subject,
        data=encode_envelope(refused.envelope),
        error=refused.reason,
    )


log = logging.getLogger(__name__)

Clock = Callable[[], datetime]
Reaction = Callable[[StoredEvent], Awaitable[None]]
BatchReaction = Callable[[list[StoredEvent]], Awaitable[None]]

CONSUME_BATCH = 1024
"""At most this many deliveries are folded before the service reacts to them."""

MAX_CONFLICT_RETRIES = 100


def utc_now() -> datetime:
    return datetime.now(UTC)


_QUEUE_ENTRIES = (PodReady, Released)
"""What a node-executor decides for a pod's queue membership (a rejection is decided node-wide:
it may rest on an entry not yet seen, e.g. a registration that just landed)."""


def expectation_writer(command: Command, events: list[Event], writer: str) -> str | None:
    """The writer whose entries on the node a decision's expectation covers; None: all of them.

    docs/eventlog.md gives the argument. A share-pool ``Assigned`` (only ``Schedule``
    decides one) can be made wrong only by another claim on the node's GPUs, and
    every share-pool claim is an admission-queue's: the expectation covers
    ``<node>.admission-queue``. A node-executor's PodReady / Released / PodRejected
    can be made wrong by none of the others' entries (only its own decide a pod's
    queue membership): ``<node>.node-executor``. A rejection may rest on an entry not
    yet seen (a registration that just landed), so it is decided node-wide. Everything else (configuration,
    registration and static bindings, inventory, preemption) keeps the node-wide
    expectation.
    """
    if isinstance(command, Schedule):
        return writer
    if isinstance(command, RequestGpu | ReportRelease) and all(
        isinstance(event, _QUEUE_ENTRIES) for event in events
    ):
        return writer
    return None


def last_entry_per_node(entries: list[StoredEvent]) -> dict[str, Envelope]:
    """The nodes a batch of events touched (in order of first touch), each with its last event."""
    touched: dict[str, Envelope] = {}
    for entry in entries:
        node = event_node(entry.envelope.event)
        if node != NODELESS:
            touched[node] = entry.envelope
    return touched


class DeciderLoop:
    def __init__(
        self,
        event_log: EventLog,
        *,
        service: str,
        projection: Projection | None = None,
        clock: Clock = utc_now,
        partition: str | None = None,
    ) -> None:
        self.log = event_log
        self.partition = partition
        """The one node whose entries this loop reads (rebuild, catch-up, consumer); None: the
        whole log. A node-executor reads only its node: it neither folds nor stores the rest
        of the cluster (docs/eventlog.md, "A node's partition")."""
        self._nodeless_rejections: set[int] = set()
        """A partitioned loop: sequences whose rejection it found on the node-less subject."""
        self.service = service
        self.projection = projection if projection is not None else Projection()
        self.clock = clock
        self.conflicts = 0
        self.decide_failures = 0
        self.ready = False
        self._node_locks: dict[str, asyncio.Lock] = {}
        self.failed = asyncio.Event()
        """Set when a background task of the service failed: the service must stop (and be
        restarted), not go on looking healthy without it."""
        self.failure: BaseException | None = None
        self._caught_up: set[tuple[int, int]] = set()
        """(sequence, index) of others' events folded by a catch-up, not yet reacted to."""
        self._refusals: list[Undecodable] = []
        """Envelopes the projection refused (admission_check), to record as MessageRejected."""
        self.writer: str = event_log.writer
        """The writer token of this service's entries (the log's)."""
        self.consume_from = self.projection.last_seq + 1
        """Where the durable starts: after the rebuild (catch-ups and own appends beyond it
        are delivered, and reacted to only if a catch-up folded them)."""

    def background(self, work: Coroutine[Any, Any, None], *, name: str) -> asyncio.Task[None]:
        """Run ``work`` beside the consumer; if it fails, the service stops with its error."""

        async def guarded() -> None:
            try:
                await work
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.exception("%s: background task %s failed", self.service, name)
                if self.failure is None:
                    self.failure = error
                self.failed.set()

        return asyncio.create_task(guarded(), name=name)

    async def rebuild(self) -> int:
        """Fold every entry present in the log; returns how many events were new.

        Unreadable entries are set aside only after the whole log is folded, and only
        those whose rejection is not already in it: a replica rebuilding from zero
        sees every rejection another replica recorded, however long ago.
        """
        folded = 0
        unreadable: list[Undecodable] = []
        async for entry in self.log.replay(
            node=self.partition, from_seq=self.projection.last_seq + 1
        ):
            if self.fold(entry):
                folded += 1
                if isinstance(entry, Undecodable):
                    unreadable.append(entry)
        self.consume_from = self.projection.last_seq + 1
        await self._set_aside_unrecorded(unreadable)
        await self._record_refusals()
        return folded

    def fold(self, entry: Entry) -> bool:
        """Fold one entry (one event of an entry) unless it was folded before."""
        if self.partition is not None:
            # read in log order from a node's subjects: what lies below is folded or not ours
            self.projection.pass_below(entry.seq)
        if isinstance(entry, StoredEvent):
            new = self.projection.apply(
                entry.seq,
                entry.envelope,
                index=entry.index,
                last=entry.last,
                writer=writer_of_subject(entry.subject),
            )
            for refused in self.projection.take_refused():
                self._refusals.append(refusal_entry(entry.subject, refused))
            return new
        return self.projection.skip(
            entry.seq, node_of_subject(entry.subject), writer_of_subject(entry.subject)
        )

    async def _record_refusals(self) -> None:
        """Set aside what the projection refused, once per entry (after folding to the end)."""
        refusals, self._refusals = self._refusals, []
        await self._set_aside_unrecorded(refusals)

    def _rejection_recorded(self, seq: int) -> bool:
        return seq in self.projection.state.rejected_sequences or seq in self._nodeless_rejections

    async def _set_aside_unrecorded(self, entries: list[Undecodable]) -> None:
        """Set aside each entry whose rejection the log does not hold yet.

        Rejections are node-less entries (``<prefix>._.<writer>``): a partitioned loop does
        not fold them, so it reads that subject from the first entry in question on (rare:
        only garbage or a refused envelope on its node brings it here)."""
        if not entries:
            return
        if self.partition is not None:
            first = min(entry.seq for entry in entries)
            async for logged in self.log.replay(node=NODELESS, from_seq=first):
                if isinstance(logged, StoredEvent) and isinstance(
                    logged.envelope.event, MessageRejected
                ):
                    named = logged.envelope.event.seq  # older rejections name it by their id
                    _, _, of_id = logged.envelope.id.partition("rejected-")
                    self._nodeless_rejections.add(named or (int(of_id) if of_id.isdigit() else 0))
        for entry in entries:
            if not self._rejection_recorded(entry.seq):
                await self._set_aside(entry)

    async def _set_aside(self, entry: Undecodable) -> None:
        log.warning(
            "%s: entry %d on %s is not a readable event (%s); set aside as MessageRejected",
            self.service,
            entry.seq,
            entry.subject,
            entry.error,
        )
        envelope = rejection_envelope(entry, time=self.clock())
        seq = await self.log.append(envelope)
        self.projection.apply(seq, envelope)

    async def execute(
        self, command: Command, *, node: str, cause: Envelope | None = None
    ) -> list[Event]:
        """Decide on the projection and append; on a conflict, catch up and decide again.

        Decisions for one node are made one at a time within this process (a lock per
        node), so only other processes can make an append conflict.
        """
        lock = self._node_locks.setdefault(node, asyncio.Lock())
        async with lock:
            return await self._execute(command, node=node, cause=cause)

    async def _execute(self, command: Command, *, node: str, cause: Envelope | None) -> list[Event]:
        for _ in range(MAX_CONFLICT_RETRIES):
            now = self.clock()
            try:
                events = decide(self.projection.state, command, now)
            except Exception:
                # A fault in deciding for one node (bad state, a core bug) must not stop the
                # service for every other node: this command decides nothing, loudly.
                self.decide_failures += 1
                log.exception("%s: deciding %s for %s failed", self.service, command, node)
                return []
            if not events:
                return []
            correlation = (
                cause.correlation_id or cause.id if cause is not None else uuid.uuid4().hex
            )
            envelopes = [
                Envelope(
                    id=uuid.uuid4().hex,
                    time=now,
                    event=event,
                    correlation_id=correlation,
                    causation_id=cause.id if cause is not None else "",
                )
                for event in events
            ]
            for event in events:
                if event_node(event) != node:
                    raise ValueError(
                        f"decided event for {event_node(event)!r} while executing for {node!r}"
                    )
            scope = expectation_writer(command, events, self.writer)
            expected = self.projection.expected_node_seq(node, scope)
            try:
                # One decision, one entry: it lands whole or not at all.
                seq = await self.log.append_decision(
                    envelopes, expected_node_seq=expected, expected_writer=scope
                )
            except ConcurrencyConflict as conflict:
                self.conflicts += 1
                if (
                    scope is not None
                    and conflict.actual is not None
                    and self.projection.learn_writer_seq(node, scope, conflict.actual)
                ):
                    continue  # nothing unseen: only the subject's number was missing
                if conflict.actual is not None and conflict.actual < expected:
                    # The log shrinks only by an operator's purge (docs/eventlog.md,
                    # "Retention"): the subject's entries up to `expected` are gone and none
                    # came after them (it would be above `expected`): expect what is there.
                    if scope is None:
                        self.projection.node_seq[node] = conflict.actual
                    else:
                        self.projection.writer_seq[(node, scope)] = conflict.actual
                    continue
                log.info("%s: %s; catching up and deciding again", self.service, conflict)
                await self._catch_up()
                continue
            self.projection.apply_entry(seq, envelopes, writer=self.writer)
            return events
        raise RuntimeError(
            f"{self.service}: gave up after {MAX_CONFLICT_RETRIES} conflicts on {node}"
        )

    async def _catch_up(self) -> None:
        """Fold what others appended since; their events still get a reaction in ``consume``.

        Only the start-up rebuild is followed by ``Service.start``, which decides for
        every node; a catch-up may fold entries of *other* nodes (or other commands'
        causes) that nothing else would react to.
        """
        unreadable: list[Undecodable] = []
        async for entry in self.log.replay(
            node=self.partition, from_seq=self.projection.last_seq + 1
        ):
            if self.fold(entry):
                if isinstance(entry, StoredEvent):
                    self._caught_up.add((entry.seq, entry.index))
                else:
                    unreadable.append(entry)
        # everything up to the log's end is folded now: a rejection already recorded is seen
        await self._set_aside_unrecorded(unreadable)
        await self._record_refusals()

    async def consume(
        self, durable: str, react: Reaction, *, react_batch: BatchReaction | None = None
    ) -> None:
        """Fold live entries and react to them; ack after the reactions committed.

        Batched: after each delivery it waited for, the loop takes every delivery
        already received (up to :data:`CONSUME_BATCH`), folds them all, then reacts
        once: ``react_batch`` with every new event of the batch, in log order (a
        service decides once per node touched), or ``react`` for each event. The
        batch's acks follow its reactions (at-least-once), sent without waiting.

        The durable starts (or, if it lags, restarts) right after the last entry the
        rebuild folded, so a restarted service is not handed the replayed log again.
        """
        subscription = self.log.subscribe(
            durable=durable, node=self.partition, from_seq=self.consume_from
        )
        try:
            self.ready = True
            async for delivery in subscription:
                deliveries = [delivery, *subscription.take_ready(CONSUME_BATCH - 1)]
                # fold the whole batch first: reactions never see a decision in part
                reactions: list[StoredEvent] = []
                for taken in deliveries:
                    for entry in taken.entries:
                        if await self._take(entry):
                            assert isinstance(entry, StoredEvent)
                            reactions.append(entry)
                if reactions:
                    if react_batch is not None:
                        await react_batch(reactions)
                    else:
                        for entry in reactions:
                            await react(entry)
                for taken in deliveries:
                    await taken.ack()
        finally:
            self.ready = False
            await subscription.aclose()

    async def _take(self, entry: Entry) -> bool:
        """Fold one delivered entry; True if it is to be reacted to."""
        # React only to entries not folded before (own appends, and the start-up
        # rebuild, after which the service decided for every node; decisions are
        # made from the state, so such a skipped reaction loses nothing), or folded
        # by a catch-up after a conflict (nothing reacted).
        new = self.fold(entry)
        if self._refusals:  # not believed (admission_check): recorded, not reacted to
            await self._catch_up()
            return False
        if isinstance(entry, Undecodable):
            if new:
                # a rejection may already lie further on in the log: look before writing one
                await self._catch_up()
                await self._set_aside_unrecorded([entry])
            return False
        key = (entry.seq, entry.index)
        caught_up = key in self._caught_up
        self._caught_up.discard(key)
        return new or caught_up
