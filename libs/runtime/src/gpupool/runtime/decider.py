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
  fails with ConcurrencyConflict: the loop catches up (from its own consumer, or
  else a replay) and decides again, so two replicas can never both commit
  conflicting decisions.
* **bad input**: an undecodable entry is set aside as a MessageRejected event
  naming its sequence, unless the log already holds one for it (set aside after
  the rebuild, so a rejection recorded long ago is seen first): recorded once.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Sequence
from datetime import UTC, datetime
from typing import Any, NamedTuple

from gpupool.core import Command, ReportRelease, RequestGpu, Schedule, decide
from gpupool.eventlog.port import (
    ConcurrencyConflict,
    DecisionAppend,
    Delivery,
    Entry,
    EventLog,
    StoredEvent,
    Subscription,
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
from gpupool.runtime.eager import start_now
from gpupool.runtime.ids import new_id
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

MAX_REMEMBERED_SUBJECTS = 4096
"""Subjects whose writer token the fold remembers (``DeciderLoop._writer_of``)."""

CATCH_UP_WAIT_S = 2.0
"""After a conflict, how long the decider waits for its own consumer to deliver the entry that
refused it; then it catches up with a replay instead (the entry went to another subscriber of
the durable, or the server is that slow)."""

ARRIVAL_RECHECK_S = 0.05
"""While a batch taken in the reader's step is in flight, how often a conflict's catch-up that
waits for ``consume`` looks again at whether that batch has come to await it (an eager task
may start the catch-up before the batch awaits that task): :class:`ReactionWaitsOnArrival`."""


class _CollectionPause:
    """Python's automatic garbage collection off while any rebuild folds the log.

    A rebuild allocates a handful of objects per entry and keeps most of them (the
    state), so the collector's passes walk ever more live objects while finding
    nothing to free (the fold makes no reference cycles): about a quarter of a
    rebuild's CPU time on a 30,000-entry log. Reference counting still frees everything
    that is dropped; the collector runs again as soon as the last rebuild ends (or
    never stops, if it was off already)."""

    def __init__(self) -> None:
        self._depth = 0
        self._resume = False

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        if self._depth == 0:
            self._resume = gc.isenabled()
            gc.disable()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0 and self._resume:
                gc.enable()


collection_paused = _CollectionPause()


_UNSEEN_SUBJECT: Any = object()
"""``DeciderLoop._writers`` has no answer for the subject yet (None is one: no writer token)."""


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


def _envelopes(
    events: list[Event], *, node: str, cause: Envelope | None, now: datetime
) -> list[Envelope]:
    """A decision's events as envelopes, caused by ``cause`` (a new correlation without one)."""
    if cause is not None:
        correlation, causation = cause.correlation_id or cause.id, cause.id
    else:
        correlation, causation = new_id(), ""
    envelopes = []
    for event in events:
        if event.node != node:
            raise ValueError(
                f"decided event for {event_node(event)!r} while executing for {node!r}"
            )
        envelopes.append(
            Envelope(
                id=new_id(),
                time=now,
                event=event,
                correlation_id=correlation,
                causation_id=causation,
            )
        )
    return envelopes


class Refusal(NamedTuple):
    """A decision refused by a conflict: what ``execute`` learns or catches up on first."""

    conflict: ConcurrencyConflict
    scope: str | None
    """The writer its expectation covered (None: the whole node)."""


class ReactionWaitsOnArrival(RuntimeError):
    """A reaction of a batch taken in the reader's step (``consume(react_on_arrival=True)``)
    waits for a conflict's catch-up, which waits for ``consume`` to fold the entry that
    refused the decision: ``consume`` folds nothing while that batch is not done.

    Only a reaction that waits for none of its decisions may react on arrival
    (docs/eventlog.md, "Deciding in the reader's step")."""


def _awaits(waiting: asyncio.Future[Any], target: asyncio.Task[Any]) -> bool:
    """``waiting`` (a task) waits for ``target``: is it, or awaits it, through the tasks and
    gathers it awaits (asyncio keeps what a task waits for private: ``_fut_waiter``)."""
    pending: list[asyncio.Future[Any]] = [waiting]
    for _ in range(_AWAIT_CHAIN_LIMIT):
        if not pending:
            return False
        future = pending.pop()
        if future is target:
            return True
        inner = getattr(future, "_fut_waiter", None)  # what a task waits for
        if inner is not None:
            pending.append(inner)
        pending.extend(getattr(future, "_children", ()))  # a gather's
    return False


_AWAIT_CHAIN_LIMIT = 256
"""How many futures ``_awaits`` visits in all (not a depth: each task, gather and child it
meets counts one); what lies beyond that many is not looked at."""


def _has_waiters(lock: asyncio.Lock) -> bool:
    """``lock`` is promised to a task still waiting for it (asyncio keeps the queue private)."""
    waiters = getattr(lock, "_waiters", None) or ()
    return any(not waiter.cancelled() for waiter in waiters)


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
        self.catch_ups_from_consumer = 0
        """Conflicts caught up from the service's own consumer (no replay opened)."""
        self.catch_up_replays = 0
        """Catch-ups that replayed the log (no consumer yet, or the entry was not delivered)."""
        self.conflicts_folded_since = 0
        """Conflicts whose refusing entry was folded by the time they were handled: decided
        again without a catch-up."""
        self.decide_failures = 0
        self.ready = False
        self._node_locks: dict[str, asyncio.Lock] = {}
        self.failed = asyncio.Event()
        """Set when a background task of the service failed: the service must stop (and be
        restarted), not go on looking healthy without it."""
        self.failure: BaseException | None = None
        self._caught_up: dict[int, set[int]] = {}
        """sequence -> indexes of others' events folded by a catch-up, not yet reacted to."""
        self._subscription: Subscription | None = None
        """The live consumer, while ``consume`` runs."""
        self._reacting = False
        """``consume`` is between taking a batch and asking for the next: only then does a
        conflict catch up from the consumer (nobody else is reading it)."""
        self._taken: list[Delivery] = []
        """Deliveries a catch-up took from the consumer: folded, to react to and ack in ``consume``."""
        self._consumer_lock = asyncio.Lock()
        """Held by a catch-up reading the consumer, and by ``consume`` taking what it took."""
        self._unacked_held = 0
        """Deliveries ``consume`` holds unacknowledged (its batch, while it reacts to it)."""
        self._acks_first = False
        """``consume(ack_before_reacting=True)``: deliveries are acked once folded."""
        self._batch_folded = asyncio.Event()
        """Set (and replaced) each time ``consume`` has folded a batch."""
        self._batch_lock = asyncio.Lock()
        """Held while ``consume`` folds and reacts to a batch: one batch at a time, in order."""
        self._holding = 0
        """Batches taken from the consumer and not done (being folded, or waiting for the
        lock): while any, a batch arriving is left to ``consume`` (after them)."""
        self._arrival_batches: set[asyncio.Task[None]] = set()
        """Batches taken in the reader's step (``react_on_arrival``) that went on as tasks
        (they waited) and are not done: cancelled when ``consume`` ends."""
        self._refusals: list[Undecodable] = []
        """Envelopes the projection refused (admission_check), to record as MessageRejected."""
        self.writer: str = event_log.writer
        """The writer token of this service's entries (the log's)."""
        self._writers: dict[str, str | None] = {}
        """Writer tokens of the subjects folded (``_writer_of``)."""
        self._own_unfolded: dict[str, int] = {}
        """node -> the last own writer-scoped entry on it that landed above an entry not
        folded yet: left to the consumer (or a replay) to fold in log order (``_fold_own``)."""
        self._own_unreacted: set[int] = set()
        """Sequences of those entries not folded yet: folded from the log, not reacted to (an
        own append, as if folded at its PubAck)."""
        self.consume_from = self.projection.last_seq + 1
        """Where the durable starts: after the rebuild (catch-ups and own appends beyond it
        are delivered, and reacted to only if a catch-up folded them)."""

    def background(
        self, work: Coroutine[Any, Any, None], *, name: str, eager: bool = False
    ) -> asyncio.Task[None]:
        """Run ``work`` beside the consumer; if it fails, the service stops with its error.

        ``eager``: ``work`` runs at once, within the caller's step, up to its first
        suspension (:func:`gpupool.runtime.eager.start_now`); it may even have finished
        when this returns."""

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

        if eager:
            return start_now(guarded(), name=name)
        return asyncio.create_task(guarded(), name=name)

    async def rebuild(self) -> int:
        """Fold every entry present in the log; returns how many events were new.

        Unreadable entries are set aside only after the whole log is folded, and only
        those whose rejection is not already in it: a replica rebuilding from zero
        sees every rejection another replica recorded, however long ago.
        """
        folded = 0
        unreadable: list[Undecodable] = []
        with collection_paused():
            async for batch in self._ordered_replay():
                folded += self._fold_ordered(batch, unreadable)  # whole, no await per entry
        self.consume_from = self.projection.last_seq + 1
        await self._set_aside_unrecorded(unreadable)
        await self._record_refusals()
        return folded

    async def _ordered_replay(self) -> AsyncIterator[list[Entry]]:
        """The partition's (or the log's) entries after the watermark, in order, every one,
        in batches (``EventLog.replay_batches``).

        A partitioned loop reads the stream's last sequence first: once the replay ended,
        every entry of the node up to it is folded (the replay stops at the node's last
        entry, read later), so the watermark passes it even if the node's last entry lies
        far below (a quiet node: docs/eventlog.md, "A node's partition")."""
        stream_end = await self.log.last_seq() if self.partition is not None else 0
        async for batch in self.log.replay_batches(
            node=self.partition, from_seq=self.projection.last_seq + 1
        ):
            yield batch
        if self.partition is not None:
            self.projection.pass_below(stream_end + 1)

    def _gap_proven(self, delivery: Delivery) -> bool:
        """A consumer's delivery may be folded now; False: a replay must fold what lies before.

        A partitioned loop passes its watermark over the sequences below a delivery only if
        nothing of its node can lie there unfolded: the delivery ``follows`` a sequence the
        watermark has passed (no entry of the node lies between). A delivery lost in flight
        and handed out again later breaks that proof for the deliveries after it, so it is
        never passed over (docs/eventlog.md, "A node's partition")."""
        projection = self.projection
        seq = delivery.seq
        if self.partition is None or seq <= projection.last_seq + 1 or projection.applied(seq):
            return True
        follows = delivery.follows
        if follows is None or follows > projection.last_seq:
            return False
        projection.pass_below(seq)
        return True

    def fold(self, entry: Entry, *, ordered: bool = False) -> bool:
        """Fold one entry (one event of an entry) unless it was folded before.

        ``ordered``: the entry comes from an ordered replay of the loop's subjects (every
        entry from the watermark on, contiguous): a partitioned loop passes what lies below
        it (folded, or another node's)."""
        projection = self.projection
        if ordered and self.partition is not None:
            projection.pass_below(entry.seq)
        if type(entry) is StoredEvent:
            subject = entry.subject
            writer = self._writers.get(subject, _UNSEEN_SUBJECT)
            if writer is _UNSEEN_SUBJECT:
                writer = self._writer_of(subject)
            new = projection.apply(
                entry.seq, entry.envelope, index=entry.index, last=entry.last, writer=writer
            )
            if projection.refused:
                for refused in projection.take_refused():
                    self._refusals.append(refusal_entry(subject, refused))
            return new
        assert isinstance(entry, Undecodable)
        return self.projection.skip(
            entry.seq, node_of_subject(entry.subject), writer_of_subject(entry.subject)
        )

    def _fold_ordered(
        self,
        batch: list[Entry],
        unreadable: list[Undecodable],
        new: list[StoredEvent] | None = None,
    ) -> int:
        """``fold(entry, ordered=True)`` for each entry of an ordered replay's batch, the
        common case inline (a rebuild spends its time here); returns how many were folded
        now. Those unreadable are added to ``unreadable``, the events to ``new`` if given
        (a rebuild needs only the count)."""
        projection = self.projection
        apply = projection.apply
        apply_one = projection.apply_one
        writers = self._writers
        partition = self.partition
        refused = projection.refused  # a deque: take_refused clears it, never replaces it
        folded = 0
        append = new.append if new is not None else None
        for entry in batch:
            if type(entry) is not StoredEvent:
                if self.fold(entry, ordered=True):
                    assert type(entry) is Undecodable
                    unreadable.append(entry)
                    folded += 1
                continue
            if partition is not None:
                projection.pass_below(entry.seq)
            subject = entry.subject
            writer = writers.get(subject, _UNSEEN_SUBJECT)
            if writer is _UNSEEN_SUBJECT:
                writer = self._writer_of(subject)
            if (
                apply_one(entry.seq, entry.envelope, writer)
                if entry.last and not entry.index  # an entry of one envelope: the common case
                else apply(
                    entry.seq, entry.envelope, index=entry.index, last=entry.last, writer=writer
                )
            ):
                folded += 1
                if append is not None:
                    append(entry)
            if refused:
                for refusal in projection.take_refused():
                    self._refusals.append(refusal_entry(subject, refusal))
        return folded

    def _writer_of(self, subject: str) -> str | None:
        """``writer_of_subject``, remembered per subject (a log has a few per node)."""
        if len(self._writers) >= MAX_REMEMBERED_SUBJECTS:
            self._writers.clear()  # garbage subjects must not grow it without bound
        writer = self._writers[subject] = writer_of_subject(subject)
        return writer

    async def _record_refusals(self) -> None:
        """Set aside what the projection refused, once per entry (after folding to the end)."""
        refusals, self._refusals = self._refusals, []
        await self._set_aside_unrecorded(refusals)

    def _rejection_recorded(self, seq: int) -> bool:
        return seq in self.projection.state.rejected_sequences or seq in self._nodeless_rejections

    async def _set_aside_unrecorded(self, entries: list[Undecodable]) -> None:
        """Set aside each entry whose rejection the log does not hold yet.

        A whole-log reader records rejections as node-less entries (``<prefix>._.<writer>``),
        a partitioned one on its node's subject: a partitioned loop folds the latter but not
        the former, so it reads the node-less subject from the first entry in question on
        (rare: only garbage or a refused envelope on its node brings it here). A whole-log
        reader folds both."""
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
        # a partitioned loop (an executor: it may append on its node's subject only) records
        # its node's rejections there; everyone else on the node-less subject
        envelope = rejection_envelope(entry, time=self.clock(), node=self.partition or NODELESS)
        seq = await self.log.append(envelope)
        self.projection.apply(seq, envelope, writer=self.writer)

    async def execute(
        self,
        command: Command,
        *,
        node: str,
        cause: Envelope | None = None,
        refused: Refusal | None = None,
    ) -> list[Event]:
        """Decide on the projection and append; on a conflict, catch up and decide again.

        Decisions for one node are made one at a time within this process (a lock per
        node), so only other processes can make an append conflict. ``refused``: the
        conflict that refused this command's decision in :meth:`execute_batch`, caught up
        before deciding again.
        """
        lock = self._node_locks.get(node)
        if lock is None:
            lock = self._node_locks[node] = asyncio.Lock()
        async with lock:
            return await self._execute(command, node=node, cause=cause, refused=refused)

    async def _execute(
        self, command: Command, *, node: str, cause: Envelope | None, refused: Refusal | None
    ) -> list[Event]:
        for _ in range(MAX_CONFLICT_RETRIES):
            await self._fold_own_left(node)
            if refused is not None:
                await self._after_conflict(node, refused)
                refused = None
            decision = self._decided(command, node, cause)
            if decision is None:
                return []
            events, envelopes, expected, scope = decision
            try:
                # One decision, one entry: it lands whole or not at all.
                seq = await self.log.append_decision(
                    envelopes, expected_node_seq=expected, expected_writer=scope
                )
            except ConcurrencyConflict as conflict:
                refused = Refusal(conflict, scope)
                continue
            self._fold_own(seq, envelopes, node, scope)
            return events
        raise RuntimeError(
            f"{self.service}: gave up after {MAX_CONFLICT_RETRIES} conflicts on {node}"
        )

    def _decided(
        self, command: Command, node: str, cause: Envelope | None
    ) -> tuple[list[Event], list[Envelope], int, str | None] | None:
        """``command`` decided on the projection now: its events, their envelopes, and the
        append's expectation (the node's sequence, and the writer it covers); None when it
        decides nothing.

        A fault in deciding for one node (bad state, a core bug) must not stop the service
        for every other node: such a command decides nothing, loudly."""
        now = self.clock()
        try:
            events = decide(self.projection.state, command, now)
        except Exception:
            self.decide_failures += 1
            log.exception("%s: deciding %s for %s failed", self.service, command, node)
            return None
        if not events:
            return None
        envelopes = _envelopes(events, node=node, cause=cause, now=now)
        scope = expectation_writer(command, events, self.writer)
        return events, envelopes, self.projection.expected_node_seq(node, scope), scope

    def _fold_own(self, seq: int, envelopes: list[Envelope], node: str, scope: str | None) -> None:
        """Fold this process's decision on ``node``, landed at ``seq``, at once where the fold
        keeps the log's order of the node's entries. Landed on a node-wide expectation
        (``scope`` None), it is the node's next entry after every one folded (perhaps ahead
        of the watermark: the rest is other nodes'): the node's sequence moves to it. Landed
        on a writer-scoped one above an entry not folded yet, it may lie above another
        writer's entry of the node, unseen, that it does not commute with (the pod removed
        before its Assigned): it is left to the consumer to fold in log order, and the
        node's next decision waits for it (``_fold_own_left``; docs/eventlog.md, "An own
        entry is folded in log order"). Not in a partitioned loop (the node-executor): its
        watermark lags on other nodes' sequences, it folds as before."""
        projection = self.projection
        if (
            scope is not None
            and self.partition is None
            and (seq != projection.last_seq + 1 or projection.ahead)
        ):
            if seq > self._own_unfolded.get(node, 0):
                self._own_unfolded[node] = seq
            self._own_unreacted.add(seq)
            return
        projection.apply_entry(seq, envelopes, writer=self.writer)
        if scope is None:
            projection.landed_node_wide(node, seq)

    def _own_left(self, node: str) -> int | None:
        """The own entry on ``node`` left to the log to fold, if it is not folded yet."""
        left = self._own_unfolded.get(node)
        if left is not None and self._folded(left):
            del self._own_unfolded[node]
            return None
        return left

    async def _fold_own_left(self, node: str) -> None:
        """Before deciding on ``node``: fold the own entry left to the log (and every entry
        before it), from the consumer if it runs, else by a replay."""
        left = self._own_left(node)
        if left is None:
            return
        if not await self._catch_up_from_consumer(left):
            await self._catch_up()
        self._own_left(node)

    async def _after_conflict(self, node: str, refused: Refusal) -> None:
        """Learn what a conflict says, or catch up, before the node's next decision."""
        conflict, scope = refused
        expected = conflict.expected
        self.conflicts += 1
        if (
            scope is not None
            and conflict.actual is not None
            and self.projection.learn_writer_seq(node, scope, conflict.actual)
        ):
            return  # nothing unseen: only the subject's number was missing
        if conflict.actual is not None and conflict.actual < expected:
            # The log shrinks only by an operator's purge (docs/eventlog.md,
            # "Retention"): the subject's entries up to `expected` are gone and none
            # came after them (it would be above `expected`): expect what is there.
            if scope is None:
                self.projection.node_seq[node] = conflict.actual
            else:
                self.projection.writer_seq[(node, scope)] = conflict.actual
            return
        if conflict.actual is not None and conflict.actual <= self.projection.last_seq:
            # Folded since the decision was made (a batch's later decisions learn their
            # conflicts after the consumer folded the refusing entry): the entry and every
            # one before it are folded, so deciding again needs no catch-up.
            self.conflicts_folded_since += 1
            return
        log.info("%s: %s; catching up and deciding again", self.service, conflict)
        if not await self._catch_up_from_consumer(conflict.actual):
            await self._catch_up()

    async def execute_batch(
        self, commands: Sequence[tuple[Command, str, Envelope | None]]
    ) -> list[tuple[int, Refusal | None]]:
        """Decide each command (``(command, node, cause)``, one per node) and append the
        decisions together; return the indexes of those to decide again with ``execute``,
        each with the conflict that refused its decision (to pass on as ``refused``).

        Every decision is made from the projection in this step and handed to the log in
        one call (:meth:`EventLog.append_decisions`: JetStream writes them together and
        awaits their PubAcks together), so a batch's decisions cost one task and one
        wait, not one each. A decision that landed is folded as ``execute`` folds it; one
        that did not (a conflict, a failed publish) is left to ``execute``, which decides
        it again from the folded state (after a conflict's catch-up): a decision is never
        lost, nor made twice (a publish that did land refuses the next one on the node's
        expectation until it is folded). So is a node whose lock is held (a decision of
        ``execute`` in flight for it); a decision that fails to be made decides nothing,
        as in ``execute``.
        """
        held: list[asyncio.Lock] = []
        again: list[tuple[int, Refusal | None]] = []
        decided: list[tuple[int, list[Envelope]]] = []
        appends: list[DecisionAppend] = []
        try:
            for index, (command, node, cause) in enumerate(commands):
                lock = self._node_locks.get(node)
                if lock is None:
                    lock = self._node_locks[node] = asyncio.Lock()
                if lock.locked() or _has_waiters(lock) or self._own_left(node) is not None:
                    # held, or just released to a waiter not run yet (acquire would queue
                    # behind it and suspend), or its last own entry is not folded yet: the
                    # node's own execute decides it (after folding that entry)
                    again.append((index, None))
                    continue
                await lock.acquire()  # free, nobody waiting: taken at once, no suspension
                held.append(lock)
                decision = self._decided(command, node, cause)
                if decision is None:
                    continue
                _, envelopes, expected, scope = decision
                decided.append((index, envelopes))
                appends.append(DecisionAppend(envelopes, expected, scope))
            if appends:
                outcomes = await self.log.append_decisions(appends)
                for (index, envelopes), append, outcome in zip(
                    decided, appends, outcomes, strict=True
                ):
                    if isinstance(outcome, int):
                        self._fold_own(
                            outcome, envelopes, commands[index][1], append.expected_writer
                        )
                    elif isinstance(outcome, ConcurrencyConflict):
                        again.append((index, Refusal(outcome, append.expected_writer)))
                    else:
                        log.info("%s: append failed (%r); deciding again", self.service, outcome)
                        again.append((index, None))
        finally:
            for lock in held:
                lock.release()
        again.sort()
        return again

    def _folded(self, seq: int) -> bool:
        """The whole entry ``seq`` is folded."""
        return seq <= self.projection.last_seq or seq in self.projection.ahead

    def _mark_caught_up(self, entry: StoredEvent) -> None:
        if self._is_own_echo(entry):
            return  # an own entry: not reacted to
        self._caught_up.setdefault(entry.seq, set()).add(entry.index)

    def _is_own_echo(self, entry: StoredEvent) -> bool:
        """``entry`` is (part of) an own append left to the log to fold (``_fold_own``): it
        is not reacted to, as if folded at its PubAck. Its sequence is forgotten with its
        last envelope, the first time it is met: by a replay's catch-up or by the consumer,
        whichever folds it (the other finds it folded, nothing new to react to)."""
        if self._own_unreacted and entry.seq in self._own_unreacted:
            if entry.last:
                self._own_unreacted.discard(entry.seq)
            return True
        return False

    async def _catch_up_from_consumer(self, actual: int | None) -> bool:
        """Fold deliveries of the service's own consumer up to entry ``actual`` (the one that
        refused an append); False: not possible here, catch up with a replay instead.

        The durable delivers in stream order, so once ``actual`` is folded every earlier
        entry of the consumer's subjects is too. While ``consume`` is reacting (it does
        not read the consumer then), what this takes from the consumer is folded now,
        reacted to and acked by ``consume`` after the current reaction (the events are
        marked as caught up, as a replay's are). While ``consume`` waits on the consumer
        (a decision running beside it: a pipelined service), this waits until it has
        folded ``actual``; ``consume`` reacts to those entries as to any. An unreadable
        or refused entry among them needs the log's end before it is recorded: a replay
        follows.
        """
        subscription = self._subscription
        if subscription is None or actual is None or self._folded(actual):
            return False
        if self._unacked_held > CONSUME_BATCH // 2:
            # the server holds back deliveries past the durable's ack-pending limit (1,000)
            return False
        if not self._reacting and self._arrival_batches:
            self._refuse_wait_of_arrival_batch(actual)
        unreadable: list[Undecodable] = []
        gap = False
        try:
            async with asyncio.timeout(CATCH_UP_WAIT_S):
                async with self._consumer_lock:
                    if self._reacting and not await self._take_from(
                        subscription, actual, unreadable
                    ):
                        gap = True
                while not gap and not self._folded(actual):  # consume folds it
                    if self._reacting or not self._arrival_batches:
                        await self._batch_folded.wait()
                        continue
                    # a batch of the reader's step in flight may come to await this
                    # catch-up only now (it started in an eager task the batch awaits later)
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(ARRIVAL_RECHECK_S):
                            await self._batch_folded.wait()
                    self._refuse_wait_of_arrival_batch(actual)
        except (TimeoutError, StopAsyncIteration):
            log.info("%s: entry %d not delivered in time; replaying", self.service, actual)
            if unreadable:
                await self._catch_up(unreadable)  # what it folded is set aside after the replay
                return True
            return False
        if gap:  # a delivery the partition cannot pass over yet: an ordered replay folds it
            await self._catch_up(unreadable)
            return True
        self.catch_ups_from_consumer += 1
        if unreadable or self._refusals:
            await self._catch_up(unreadable)
        return True

    def _refuse_wait_of_arrival_batch(self, actual: int) -> None:
        """Raise :class:`ReactionWaitsOnArrival` if a batch taken in the reader's step awaits
        this catch-up (it runs in that batch's task, or in a task or gather it awaits): the
        catch-up would wait for ``consume`` to fold ``actual``, and ``consume`` waits for
        that batch (it holds the batch lock). Looked at only on a conflict's catch-up: when
        it starts and, while it waits for ``consume`` with such a batch in flight, each
        :data:`ARRIVAL_RECHECK_S`."""
        catching_up = asyncio.current_task()
        if catching_up is None:
            return
        for batch in self._arrival_batches:
            if _awaits(batch, catching_up):
                raise ReactionWaitsOnArrival(
                    f"{self.service}: a reaction of a batch taken in the reader's step "
                    f"(react_on_arrival) waits for the catch-up after a conflict on entry "
                    f"{actual}, which consume cannot fold before that batch is done: "
                    "react on arrival only with reactions that wait for none of their "
                    "decisions"
                )

    async def _take_from(
        self, subscription: Subscription, actual: int, unreadable: list[Undecodable]
    ) -> bool:
        """Fold deliveries up to ``actual``; False: a gap ``_gap_proven`` cannot pass came first
        (the rest is left to a replay and to ``consume``)."""
        gap = False
        while not gap and not self._folded(actual):
            ready = subscription.take_ready(CONSUME_BATCH)
            if not ready:
                ready = [await subscription.__anext__()]
            self._taken += ready
            for delivery in ready:
                gap = gap or not self._gap_proven(delivery)
                if not gap and not self._folded(delivery.seq):
                    for entry in delivery.entries:
                        if not self.fold(entry):
                            continue
                        if isinstance(entry, StoredEvent):
                            self._mark_caught_up(entry)
                        else:
                            unreadable.append(entry)
                if self._acks_first:
                    await delivery.ack()  # the server's ack-pending limit stays free
                else:
                    self._unacked_held += 1
        return not gap

    async def keep_up(self) -> None:
        """A partitioned loop: fold what its node has beyond the watermark and pass the
        watermark to the stream's end (cheap when the node was quiet: nothing is replayed).

        Its consumer moves the watermark only on the node's own entries; called before each
        snapshot, this keeps a quiet node's snapshot up with the log, so a purge of the log
        does not find it behind (docs/eventlog.md, "A node's partition")."""
        if self.partition is not None:
            await self._catch_up(counted=False)

    async def _catch_up(
        self, unreadable: list[Undecodable] | None = None, *, counted: bool = True
    ) -> None:
        """Fold what others appended since; their events still get a reaction in ``consume``.

        Only the start-up rebuild is followed by ``Service.start``, which decides for
        every node; a catch-up may fold entries of *other* nodes (or other commands'
        causes) that nothing else would react to. ``unreadable``: entries folded before
        (from the consumer) still to be set aside once the log's end is folded.
        """
        if counted:
            self.catch_up_replays += 1
        unreadable = list(unreadable or ())
        new: list[StoredEvent] = []
        async for batch in self._ordered_replay():
            self._fold_ordered(batch, unreadable, new)
            for entry in new:
                self._mark_caught_up(entry)
            new.clear()
        # everything up to the log's end is folded now: a rejection already recorded is seen
        await self._set_aside_unrecorded(unreadable)
        await self._record_refusals()

    async def consume(
        self,
        durable: str,
        react: Reaction,
        *,
        react_batch: BatchReaction | None = None,
        ack_before_reacting: bool = False,
        react_on_arrival: bool = False,
    ) -> None:
        """Fold live entries and react to them; ack after the reactions committed.

        Batched: after each delivery it waited for, the loop takes every delivery
        already received (up to :data:`CONSUME_BATCH`), folds them all, then reacts
        once: ``react_batch`` with every new event of the batch, in log order (a
        service decides once per node touched), or ``react`` for each event. The
        batch's acks follow its reactions (at-least-once), sent without waiting.

        With ``ack_before_reacting`` a batch is acked as soon as it is folded, before the
        reactions: for a service whose reactions are decided from the state alone and
        which decides for every node at start (the admission-queue), a reaction lost to
        a crash is decided again after the restart; the acks leave the decision path
        and the server sends the next batch (and a conflict's catch-up) meanwhile.

        With ``react_on_arrival`` (a service whose batch reaction starts its decisions and
        returns without waiting for them: the pipelined admission-queue) a batch that
        arrives while the loop waits is folded and reacted to within the step that
        received it (``Subscription.react_on_arrival``: the connection's reader step),
        as a task started eagerly, instead of on a later turn of the event loop; batches
        stay one at a time, in order (docs/eventlog.md, "Deciding in the reader's step").
        A reaction of such a batch that waits for a conflict's catch-up (its own decision
        refused) raises :class:`ReactionWaitsOnArrival`: the catch-up would wait for this
        loop to fold, and it folds nothing before that batch is done.

        The durable starts (or, if it lags, restarts) right after the last entry the
        rebuild folded, so a restarted service is not handed the replayed log again.
        """
        subscription = self.log.subscribe(
            durable=durable, node=self.partition, from_seq=self.consume_from
        )
        self._subscription = subscription
        self._acks_first = ack_before_reacting
        consumer = asyncio.current_task()
        arrived = self._arrival_batches
        failures: list[BaseException] = []

        async def fold_and_react(deliveries: list[Delivery], *, taken_by_consume: bool) -> None:
            self._holding += 1
            try:
                async with self._batch_lock:  # free unless a batch is being folded: no wait
                    await self._consume_batch(
                        subscription,
                        deliveries,
                        react,
                        react_batch,
                        ack_before_reacting=ack_before_reacting,
                        taken_by_consume=taken_by_consume,
                    )
            finally:
                self._holding -= 1

        async def on_arrival_batch(deliveries: list[Delivery]) -> None:
            try:
                await fold_and_react(deliveries, taken_by_consume=False)
            except Exception as error:
                failures.append(error)  # consume ends with it, as with its own batch's
                if consumer is not None:
                    consumer.cancel()

        def on_arrival() -> bool:
            # In the reader's step: a batch held (or waited for) by consume goes first, and a
            # failed one ends consume; else the deliveries received are this batch.
            if self._holding or failures:
                return False
            deliveries = subscription.take_ready(CONSUME_BATCH)
            if not deliveries:
                return False
            task = start_now(on_arrival_batch(deliveries), name=f"{self.service} batch")
            if not task.done():  # it waits (a catch-up's replay): consume waits for it
                arrived.add(task)
                task.add_done_callback(arrived.discard)
            return True

        if react_on_arrival:
            subscription.react_on_arrival(on_arrival)
        try:
            self.ready = True
            async for delivery in subscription:
                await fold_and_react(
                    [delivery, *subscription.take_ready(CONSUME_BATCH - 1)],
                    taken_by_consume=True,
                )
        except asyncio.CancelledError:
            if failures and consumer is not None and consumer.uncancel() == 0:
                raise failures[0] from None
            raise
        finally:
            if react_on_arrival:
                subscription.react_on_arrival(None)
            for task in list(arrived):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            self.ready = False
            self._reacting = False
            self._subscription = None
            await subscription.aclose()

    async def _consume_batch(
        self,
        subscription: Subscription,
        deliveries: list[Delivery],
        react: Reaction,
        react_batch: BatchReaction | None,
        *,
        ack_before_reacting: bool,
        taken_by_consume: bool,
    ) -> None:
        """``consume``'s batch: fold it whole, ack, react, then what a catch-up took meanwhile.

        ``taken_by_consume``: consume took the batch from the consumer and does not read it
        until the batch is done, so a conflict's catch-up may read it meanwhile
        (``_reacting``); a batch taken in the reader's step (``react_on_arrival``) leaves
        consume waiting on the consumer: a catch-up waits for consume to fold instead."""
        self._reacting = taken_by_consume
        try:
            while True:
                # fold the whole batch first: reactions never see a decision in part
                reactions: list[StoredEvent] = []
                for taken in deliveries:
                    if self._folded(taken.seq) and taken.seq not in self._caught_up:
                        continue  # folded before (an own append): acked unread
                    if not self._gap_proven(taken):
                        await self._catch_up()  # folds what lies before it, in order
                    for entry in taken.entries:
                        if await self._take(entry):
                            assert isinstance(entry, StoredEvent)
                            reactions.append(entry)
                folded, self._batch_folded = self._batch_folded, asyncio.Event()
                folded.set()
                if ack_before_reacting:
                    await subscription.ack_many(deliveries)
                    self._unacked_held = len(self._taken)
                else:
                    self._unacked_held = len(deliveries) + len(self._taken)
                if reactions:
                    if react_batch is not None:
                        await react_batch(reactions)
                    else:
                        for entry in reactions:
                            await react(entry)
                if not ack_before_reacting:
                    # the batch's last frames: written in this step, not on the flusher's turn
                    await subscription.ack_many(deliveries, now=True)
                    self._unacked_held = len(self._taken)
                async with self._consumer_lock:
                    # what a conflict's catch-up took from the consumer meanwhile
                    deliveries, self._taken = self._taken, []
                    if not deliveries:
                        return
        finally:
            self._reacting = False

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
        if self._is_own_echo(entry):
            return False  # an own append, folded in log order: not reacted to
        indexes = self._caught_up.get(entry.seq)
        caught_up = indexes is not None and entry.index in indexes
        if caught_up:
            assert indexes is not None
            indexes.discard(entry.index)
            if not indexes:
                del self._caught_up[entry.seq]
        return new or caught_up
