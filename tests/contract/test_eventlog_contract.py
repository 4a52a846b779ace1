"""One contract for the event log, run against InMemoryEventLog and real JetStream.

Every test takes ``event_log`` (parametrized: memory, jetstream) and ``reopen``,
which gives a second handle on the same log: the same object in memory, a new
connection for JetStream (what a restarted service gets).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from itertools import count

import pytest

from gpupool.eventlog import (
    DEFAULT_WRITER,
    ConcurrencyConflict,
    DecisionAppend,
    Delivery,
    EventLog,
    EventLogClosed,
    InMemoryEventLog,
    JetStreamEventLog,
    StoredEvent,
    Subscription,
    Undecodable,
    memory,
    node_of_subject,
    node_token,
    pulled_replay,
    rejection_envelope,
    writer_of_subject,
    writer_subject_filter,
)
from gpupool.events import (
    NODELESS,
    Assigned,
    Envelope,
    Event,
    MessageRejected,
    PodReady,
    PodRef,
    Released,
    encode_envelope,
)

Reopen = Callable[[], Awaitable[EventLog]]
WAIT_S = 10.0
"""Upper bound for anything a test waits on; normally milliseconds."""

_ids = count(1)
T0 = datetime(2025, 1, 1, tzinfo=UTC)


def ready(node: str = "gpu-1", pod: str = "p") -> PodReady:
    return PodReady(pod=PodRef(namespace="default", name=pod), node=node)


def assigned(node: str = "gpu-1", pod: str = "p") -> Assigned:
    return Assigned(
        pod=PodRef(namespace="default", name=pod), node=node, gpu_index=0, gpu_uuid="GPU-0"
    )


def wrap(event: Event, envelope_id: str | None = None) -> Envelope:
    return Envelope(id=envelope_id or f"ev-{next(_ids)}", time=T0, event=event)


@pytest.fixture(params=["memory", "jetstream"])
def event_log(request: pytest.FixtureRequest) -> EventLog:
    log: EventLog = request.getfixturevalue(f"{request.param}_log")
    return log


@pytest.fixture
async def reopen(event_log: EventLog, request: pytest.FixtureRequest) -> AsyncIterator[Reopen]:
    opened: list[JetStreamEventLog] = []

    async def open_again() -> EventLog:
        if isinstance(event_log, InMemoryEventLog):
            return event_log
        assert isinstance(event_log, JetStreamEventLog)
        log = await JetStreamEventLog.connect(
            request.getfixturevalue("nats_url"),
            stream=event_log.stream,
            subject_prefix=event_log.subject_prefix,
        )
        opened.append(log)
        return log

    yield open_again
    for log in opened:
        await log.close()


def prefix_of(log: EventLog) -> str:
    assert isinstance(log, InMemoryEventLog | JetStreamEventLog)
    return log.subject_prefix


async def collect(log: EventLog, **kwargs: object) -> list[StoredEvent | Undecodable]:
    return [entry async for entry in log.replay(**kwargs)]  # type: ignore[arg-type]


async def next_delivery(subscription: Subscription) -> Delivery:
    return await asyncio.wait_for(anext(subscription), timeout=WAIT_S)


def envelope_of(entry: StoredEvent | Undecodable) -> Envelope:
    assert isinstance(entry, StoredEvent), entry
    return entry.envelope


# --------------------------------------------------------------------------- append and replay


async def test_replay_returns_appended_envelopes_in_order_with_their_seqs(
    event_log: EventLog,
) -> None:
    envelopes = [wrap(ready(pod=f"p{i}")) for i in range(5)]
    seqs = [await event_log.append(envelope) for envelope in envelopes]

    entries = await collect(event_log)

    assert seqs == sorted(set(seqs))
    assert len(seqs) == 5
    assert [entry.seq for entry in entries] == seqs
    assert [envelope_of(entry) for entry in entries] == envelopes
    assert await event_log.last_seq() == seqs[-1]


async def test_subject_is_node_token_and_writer(event_log: EventLog) -> None:
    await event_log.append(wrap(ready(node="node.a.example")))
    await event_log.append_decision(
        [wrap(ready(node="node.a.example", pod="p1")), wrap(ready(node="node.a.example", pod="p2"))]
    )
    await event_log.append(wrap(MessageRejected(subject="x", reason="r", payload="")))

    subjects = [entry.subject for entry in await collect(event_log)]

    prefix = prefix_of(event_log)
    writer = DEFAULT_WRITER  # the fixtures' logs are not one of the services
    assert subjects == [
        f"{prefix}.node_a_example.{writer}",
        f"{prefix}.node_a_example.{writer}",
        f"{prefix}.node_a_example.{writer}",
        f"{prefix}._.{writer}",
    ]
    assert {writer_of_subject(subject) for subject in subjects} == {writer}


async def test_a_named_writer_appends_under_its_own_token(
    nats_url: str, jetstream_log: JetStreamEventLog
) -> None:
    prefix = jetstream_log.subject_prefix
    log = await JetStreamEventLog.connect(
        nats_url, stream=jetstream_log.stream, subject_prefix=prefix, writer="admission-queue"
    )
    memory = InMemoryEventLog(subject_prefix=prefix, writer="admission-queue")
    try:
        for each in (log, memory):
            await each.append(wrap(ready(node="n.1")))
            [entry] = await collect(each)
            assert entry.subject == f"{prefix}.n_1.admission-queue"
            assert node_of_subject(entry.subject) == "n.1"
            assert entry.subject == writer_subject_filter("admission-queue", "n.1", prefix=prefix)
    finally:
        await log.close()
    assert writer_subject_filter("preemption", prefix=prefix) == f"{prefix}.*.preemption"


@pytest.mark.parametrize("writer", ["", "Policy", "a.b", "a*", ">", "x" * 64, "a b"])
def test_a_writer_that_is_no_subject_token_is_refused(writer: str) -> None:
    with pytest.raises(ValueError, match="subject token"):
        InMemoryEventLog(writer=writer)


async def test_replay_filters_by_node_and_starts_at_from_seq(event_log: EventLog) -> None:
    a1 = await event_log.append(wrap(ready(node="a.1", pod="x")))
    b1 = await event_log.append(wrap(ready(node="b", pod="y")))
    a2 = await event_log.append(wrap(assigned(node="a.1", pod="x")))
    nodeless = await event_log.append(wrap(MessageRejected(subject="s", reason="r", payload="")))
    # "a" must not match the node "a.1" (token a_1), nor "a_1" prefixes.
    await event_log.append(wrap(ready(node="a", pod="z")))

    assert [e.seq for e in await collect(event_log, node="a.1")] == [a1, a2]
    assert [e.seq for e in await collect(event_log, node="b")] == [b1]
    assert [e.seq for e in await collect(event_log, node=NODELESS)] == [nodeless]
    assert [e.seq for e in await collect(event_log, node="a.1", from_seq=a1 + 1)] == [a2]
    assert [e.seq for e in await collect(event_log, from_seq=b1)] == [b1, a2, nodeless, a2 + 2]


async def test_replay_of_nothing_ends_at_once(event_log: EventLog) -> None:
    assert await collect(event_log) == []
    seq = await event_log.append(wrap(ready(node="a")))
    assert await collect(event_log, node="nobody") == []
    assert await collect(event_log, from_seq=seq + 1) == []
    assert await collect(event_log, node="a", from_seq=seq + 1) == []


async def test_replay_stops_at_the_last_entry_present_when_it_started(event_log: EventLog) -> None:
    first = [await event_log.append(wrap(ready(pod=f"p{i}"))) for i in range(3)]
    seen: list[int] = []
    async for entry in event_log.replay():
        seen.append(entry.seq)
        # Entries appended during the replay are not part of it.
        await event_log.append(wrap(ready(pod=f"late{entry.seq}")))
    assert seen == first
    assert await event_log.last_seq() == first[-1] + 3


async def test_replay_batches_hand_out_the_replay_s_entries_never_splitting_a_decision(
    event_log: EventLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(memory, "REPLAY_BATCH", 2)  # small batches: several of them
    monkeypatch.setattr(pulled_replay, "REPLAY_BATCH", 2)
    await event_log.append(wrap(ready(pod="a")))
    await event_log.append(wrap(ready(node="gpu-2", pod="b")))
    await event_log.append_decision([wrap(ready(pod=f"d{i}")) for i in range(3)])
    await event_log.append_raw(f"{prefix_of(event_log)}.gpu-1.{DEFAULT_WRITER}", b"garbage")
    await event_log.append(wrap(ready(pod="c")))
    for options in ({}, {"node": "gpu-1"}, {"from_seq": 3}, {"node": "gpu-1", "from_seq": 4}):
        batches = [batch async for batch in event_log.replay_batches(**options)]  # type: ignore[arg-type]
        assert all(batches)
        assert [entry for batch in batches for entry in batch] == await collect(
            event_log, **options
        )
        for batch in batches:  # a decision entry's envelopes all in one batch
            last = batch[-1]
            assert not isinstance(last, StoredEvent) or last.last


async def test_breaking_out_of_a_replay_leaves_the_log_usable(event_log: EventLog) -> None:
    for i in range(10):
        await event_log.append(wrap(ready(pod=f"p{i}")))
    replay = event_log.replay()
    async for _ in replay:
        break
    await replay.aclose()  # type: ignore[attr-defined]
    assert len(await collect(event_log)) == 10


# --------------------------------------------------------------------------- dedupe


async def test_appending_the_same_id_twice_gives_one_entry_and_the_original_seq(
    event_log: EventLog,
) -> None:
    envelope = wrap(ready())
    first = await event_log.append(envelope)
    await event_log.append(wrap(ready(pod="other")))

    again = await event_log.append(envelope)

    assert again == first
    assert [e.seq for e in await collect(event_log)] == [first, first + 1]


async def test_retrying_an_append_with_its_expectation_returns_the_original_seq(
    event_log: EventLog,
) -> None:
    envelope = wrap(ready(node="n"))
    first = await event_log.append(envelope, expected_node_seq=0)

    # A retry after a lost ack carries the same expectation, now stale.
    again = await event_log.append(envelope, expected_node_seq=0)

    assert again == first
    assert len(await collect(event_log)) == 1


async def test_a_rejection_is_recorded_once_whoever_records_it(event_log: EventLog) -> None:
    prefix = prefix_of(event_log)
    garbage_seq = await event_log.append_raw(f"{prefix}.n.PodReady", b"\xff not json")
    [garbage] = await collect(event_log)
    assert isinstance(garbage, Undecodable)

    by_one = await event_log.append(rejection_envelope(garbage, time=T0))
    by_another = await event_log.append(rejection_envelope(garbage, time=T0))

    assert by_one == by_another
    [_, rejected] = await collect(event_log)
    assert rejected.subject == f"{prefix}._.{DEFAULT_WRITER}"
    event = envelope_of(rejected).event
    assert isinstance(event, MessageRejected)
    assert event.subject == garbage.subject
    assert envelope_of(rejected).id == f"rejected-{garbage_seq}"


# --------------------------------------------------------------------------- optimistic concurrency


async def test_expected_zero_means_the_node_has_no_entry_yet(event_log: EventLog) -> None:
    await event_log.append(wrap(ready(node="other")))
    first = await event_log.append(wrap(ready(node="n")), expected_node_seq=0)

    with pytest.raises(ConcurrencyConflict) as caught:
        await event_log.append(wrap(assigned(node="n")), expected_node_seq=0)

    assert (caught.value.node, caught.value.expected, caught.value.actual) == ("n", 0, first)


async def test_expectation_is_per_node_across_all_tags(event_log: EventLog) -> None:
    n1 = await event_log.append(wrap(ready(node="n")), expected_node_seq=0)
    # Entries of other nodes do not move n's sequence.
    await event_log.append(wrap(ready(node="m")))
    await event_log.append(wrap(ready(node="n.sub")))
    n2 = await event_log.append(wrap(assigned(node="n")), expected_node_seq=n1)
    # A different tag on the same node does move it.
    with pytest.raises(ConcurrencyConflict):
        await event_log.append(
            wrap(Released(pod=PodRef(namespace="d", name="p"), node="n", reason="completed")),
            expected_node_seq=n1,
        )
    assert await event_log.append(wrap(ready(node="n", pod="q")), expected_node_seq=n2) > n2


async def test_an_expectation_narrowed_to_a_writer_ignores_the_other_writers_entries(
    event_log: EventLog,
) -> None:
    prefix = prefix_of(event_log)
    mine = await event_log.append(wrap(ready(node="n")), expected_node_seq=0)
    # another writer's entry on the same node, and garbage there: neither moves my subject
    await event_log.append_raw(
        f"{prefix}.n.node-executor", encode_envelope(wrap(ready(node="n", pod="q")))
    )
    await event_log.append_raw(f"{prefix}.n.node-executor", b"junk")

    second = await event_log.append_decision(
        [wrap(assigned(node="n"))], expected_node_seq=mine, expected_writer=DEFAULT_WRITER
    )

    # the node-wide expectation still sees them; my own newer entry moves my subject
    with pytest.raises(ConcurrencyConflict):
        await event_log.append(wrap(assigned(node="n", pod="q")), expected_node_seq=mine)
    with pytest.raises(ConcurrencyConflict) as caught:
        await event_log.append_decision(
            [wrap(assigned(node="n", pod="r"))],
            expected_node_seq=mine,
            expected_writer=DEFAULT_WRITER,
        )
    assert caught.value.actual == second
    # a writer that has appended nothing on the node expects 0
    assert (
        await event_log.append_decision(
            [wrap(assigned(node="n", pod="s"))], expected_node_seq=0, expected_writer="policy"
        )
        > second
    )


async def test_garbage_on_a_node_subject_counts_for_its_sequence(event_log: EventLog) -> None:
    n1 = await event_log.append(wrap(ready(node="n")), expected_node_seq=0)
    await event_log.append_raw(f"{prefix_of(event_log)}.n.Junk", b"junk")
    with pytest.raises(ConcurrencyConflict):
        await event_log.append(wrap(assigned(node="n")), expected_node_seq=n1)


async def test_two_concurrent_writers_with_the_same_expectation_exactly_one_wins(
    event_log: EventLog,
) -> None:
    base = await event_log.append(wrap(ready(node="n")), expected_node_seq=0)
    for round_ in range(10):
        # Different tags, so the two land on different subjects of the same node.
        results = await asyncio.gather(
            event_log.append(wrap(assigned(node="n", pod=f"a{round_}")), expected_node_seq=base),
            event_log.append(wrap(ready(node="n", pod=f"b{round_}")), expected_node_seq=base),
            return_exceptions=True,
        )
        won = [r for r in results if isinstance(r, int)]
        lost = [r for r in results if isinstance(r, ConcurrencyConflict)]
        assert (len(won), len(lost)) == (1, 1), results
        base = won[0]
    assert len(await collect(event_log, node="n")) == 11


async def test_decisions_appended_together_land_each_on_its_own_expectation(
    event_log: EventLog,
) -> None:
    """``append_decisions``: one outcome per decision, in order; a conflict refuses only its own."""
    a = await event_log.append(wrap(ready(node="a")), expected_node_seq=0)
    rival = await event_log.append(wrap(ready(node="b")), expected_node_seq=0)
    pair = [wrap(assigned(node="c", pod="x")), wrap(assigned(node="c", pod="y"))]

    outcomes = await event_log.append_decisions(
        [
            DecisionAppend([wrap(assigned(node="a"))], a),
            DecisionAppend([wrap(assigned(node="b"))], 0),  # b has an entry: refused
            DecisionAppend(pair, 0, DEFAULT_WRITER),
        ]
    )

    landed_a, refused, landed_c = outcomes
    assert isinstance(landed_a, int) and isinstance(landed_c, int)
    assert isinstance(refused, ConcurrencyConflict)
    assert (refused.node, refused.expected, refused.actual) == ("b", 0, rival)
    assert [e.seq for e in await collect(event_log, node="b")] == [rival]
    assert [envelope_of(e) for e in await collect(event_log, node="c")] == pair  # one entry, whole
    # the same decision again (its publish retried): its sequence, nothing added
    assert await event_log.append_decisions([DecisionAppend(pair, 0, DEFAULT_WRITER)]) == [landed_c]
    assert await event_log.last_seq() == landed_c


async def test_a_decision_that_cannot_be_framed_fails_alone_among_decisions(
    event_log: EventLog,
) -> None:
    mixed = [wrap(assigned(node="a")), wrap(assigned(node="b", pod="q"))]  # two nodes: refused

    empty, two_nodes, landed = await event_log.append_decisions(
        [DecisionAppend([]), DecisionAppend(mixed), DecisionAppend([wrap(ready(node="c"))], 0)]
    )

    assert isinstance(empty, ValueError) and isinstance(two_nodes, ValueError)
    assert isinstance(landed, int)
    assert [e.seq for e in await collect(event_log)] == [landed]


# --------------------------------------------------------------------------- append_many


async def test_append_many_without_expectation_keeps_order_and_dedupes(event_log: EventLog) -> None:
    envelopes = [wrap(ready(node=f"n{i % 3}", pod=f"p{i}")) for i in range(50)]
    seqs = await event_log.append_many(envelopes)

    assert seqs == list(range(seqs[0], seqs[0] + 50))
    assert await event_log.append_many(envelopes[10:20]) == seqs[10:20]
    assert [envelope_of(e) for e in await collect(event_log)] == envelopes


async def test_append_many_with_an_expectation_is_one_decision_entry(event_log: EventLog) -> None:
    first = await event_log.append(wrap(ready(node="n")), expected_node_seq=0)
    batch = [wrap(assigned(node="n", pod=f"p{i}")) for i in range(3)]

    seqs = await event_log.append_many(batch, expected_node_seq=first)

    assert seqs == [first + 1] * 3
    assert await event_log.last_seq() == first + 1
    with pytest.raises(ConcurrencyConflict):
        await event_log.append_many([wrap(ready(node="n", pod="late"))], expected_node_seq=first)
    assert await event_log.last_seq() == first + 1


async def test_a_decision_is_committed_whole_or_not_at_all(event_log: EventLog) -> None:
    """Finding 1: a decision's events can no longer land in part, with a writer between them."""
    decision = [wrap(ready(node="n", pod="a")), wrap(assigned(node="n", pod="a"))]
    rival = await event_log.append(wrap(ready(node="n", pod="rival")), expected_node_seq=0)

    with pytest.raises(ConcurrencyConflict):
        await event_log.append_decision(decision, expected_node_seq=0)

    entries = await collect(event_log, node="n")
    assert [e.seq for e in entries] == [rival]  # nothing of the refused decision landed
    seq = await event_log.append_decision(decision, expected_node_seq=rival)
    assert await event_log.append_decision(decision, expected_node_seq=rival) == seq  # dedupe
    entries = await collect(event_log, node="n")
    stored = [e for e in entries if e.seq == seq]
    assert [envelope_of(e) for e in stored] == decision
    assert [(e.index, e.last) for e in stored if isinstance(e, StoredEvent)] == [
        (0, False),
        (1, True),
    ]


async def test_a_decision_entry_is_delivered_as_one_message(event_log: EventLog) -> None:
    decision = [wrap(ready(node="n", pod="a")), wrap(assigned(node="n", pod="a"))]
    seq = await event_log.append_decision(decision, expected_node_seq=0)
    async with event_log.subscribe(durable="whole") as subscription:
        delivery = await asyncio.wait_for(anext(subscription), WAIT_S)
        assert [entry.seq for entry in delivery.entries] == [seq, seq]
        assert [envelope_of(entry) for entry in delivery.entries] == decision
        await delivery.ack()


async def test_a_delivery_names_its_sequence_and_can_be_acked_unread(
    event_log: EventLog,
) -> None:
    first = await event_log.append(wrap(ready(pod="a")))
    garbage = await event_log.append_raw(f"{prefix_of(event_log)}._.Whatever", b"\x00")
    async with event_log.subscribe(durable="unread") as subscription:
        skipped = await next_delivery(subscription)
        assert skipped.seq == first
        await skipped.ack()  # folded before (say, its own append): nothing decoded
        bad = await next_delivery(subscription)
        assert bad.seq == garbage == bad.entry.seq
        await bad.ack()
    later = await event_log.append(wrap(ready(pod="b")))
    async with event_log.subscribe(durable="unread") as again:
        assert (await next_delivery(again)).seq == later  # both acked: neither comes back


async def test_a_durable_starts_where_its_subscriber_folded_to(
    event_log: EventLog, reopen: Reopen
) -> None:
    """Finding 8: a service rebuilt from zero is not handed the folded log a second time."""
    seqs = [await event_log.append(wrap(ready(node="n", pod=f"p{i}"))) for i in range(5)]
    async with event_log.subscribe(durable="late", from_seq=seqs[3]) as subscription:
        delivery = await asyncio.wait_for(anext(subscription), WAIT_S)
        assert delivery.entry.seq == seqs[3]
        await delivery.ack()
    # a known durable that acknowledged less than its subscriber folded starts after that
    again = await reopen()
    async with again.subscribe(durable="late", from_seq=seqs[4] + 1) as subscription:
        later = await again.append(wrap(ready(node="n", pod="later")))
        delivery = await asyncio.wait_for(anext(subscription), WAIT_S)
        assert delivery.entry.seq == later
        await delivery.ack()


async def test_append_many_with_expectation_needs_one_node(event_log: EventLog) -> None:
    with pytest.raises(ValueError, match="one node"):
        await event_log.append_many(
            [wrap(ready(node="a")), wrap(ready(node="b"))], expected_node_seq=0
        )
    assert await event_log.last_seq() == 0


# --------------------------------------------------------------------------- undecodable entries


async def test_garbage_comes_out_as_undecodable_and_the_replay_goes_on(event_log: EventLog) -> None:
    prefix = prefix_of(event_log)
    good1 = await event_log.append(wrap(ready(node="n")))
    junk = await event_log.append_raw(f"{prefix}.n.PodReady", b"{not json")
    future = encode_envelope(wrap(ready(node="n"))).replace(b'"schema":2', b'"schema":99')
    unknown_version = await event_log.append_raw(f"{prefix}.n.PodReady", future)
    good2 = await event_log.append(wrap(assigned(node="n")))

    entries = await collect(event_log, node="n")

    assert [e.seq for e in entries] == [good1, junk, unknown_version, good2]
    assert [type(e) for e in entries] == [StoredEvent, Undecodable, Undecodable, StoredEvent]
    bad, versioned = entries[1], entries[2]
    assert isinstance(bad, Undecodable)
    assert bad.data == b"{not json"
    assert "not a gpupool envelope" in bad.error
    assert isinstance(versioned, Undecodable)
    assert "99" in versioned.error


async def test_append_raw_refuses_subjects_outside_the_log(event_log: EventLog) -> None:
    with pytest.raises(ValueError, match="not a subject of this log"):
        await event_log.append_raw("elsewhere.n.PodReady", b"x")


# --------------------------------------------------------------------------- subscribe


async def test_subscribe_delivers_entries_appended_later(event_log: EventLog) -> None:
    async with event_log.subscribe(durable="live") as subscription:
        first = await event_log.append(wrap(ready()))
        delivery = await next_delivery(subscription)
        assert delivery.entry.seq == first
        await delivery.ack()
        # The subscriber is running and has caught up; now it waits for what comes next.
        waiting = asyncio.create_task(next_delivery(subscription))
        later = await event_log.append(wrap(assigned()))
        delivery = await waiting
        assert delivery.entry.seq == later
        await delivery.ack()


async def test_a_new_durable_starts_at_the_beginning_and_filters_by_node(
    event_log: EventLog,
) -> None:
    await event_log.append(wrap(ready(node="a")))
    b = await event_log.append(wrap(ready(node="b")))
    await event_log.append(wrap(ready(node="a", pod="q")))
    b2 = await event_log.append(wrap(assigned(node="b")))

    subscription = event_log.subscribe(durable="only-b", node="b")
    seen = []
    for _ in range(2):
        delivery = await next_delivery(subscription)
        seen.append(delivery.entry.seq)
        await delivery.ack()
    await subscription.aclose()

    assert seen == [b, b2]


async def test_unacked_entries_go_to_the_next_subscriber_acked_ones_do_not(
    event_log: EventLog, reopen: Reopen
) -> None:
    s1 = await event_log.append(wrap(ready(pod="1")))
    s2 = await event_log.append(wrap(ready(pod="2")))
    first = event_log.subscribe(durable="worker")
    d1 = await next_delivery(first)
    await d1.ack()
    d2 = await next_delivery(first)
    assert (d1.entry.seq, d2.entry.seq) == (s1, s2)
    await first.aclose()  # s2 was never acked

    restarted = await reopen()
    second = restarted.subscribe(durable="worker")
    again = await next_delivery(second)
    assert again.entry.seq == s2
    await again.ack()
    s3 = await restarted.append(wrap(ready(pod="3")))
    after = await next_delivery(second)
    assert after.entry.seq == s3  # not s1: it was acked
    await after.ack()
    await second.aclose()


async def test_a_nak_delivers_the_entry_again(event_log: EventLog) -> None:
    seq = await event_log.append(wrap(ready()))
    subscription = event_log.subscribe(durable="naks")
    delivery = await next_delivery(subscription)
    await delivery.nak()
    again = await next_delivery(subscription)
    assert again.entry.seq == seq
    assert again.entry == delivery.entry
    await again.ack()
    await subscription.aclose()


async def test_a_first_delivery_proves_what_it_follows_and_a_redelivery_proves_nothing(
    event_log: EventLog,
) -> None:
    """``Delivery.follows``: no entry of the subscription's subjects lies between it and the
    delivery (a partitioned reader passes its watermark over that gap only)."""
    first = await event_log.append(wrap(ready(node="gpu-1", pod="a")))
    await event_log.append(wrap(ready(node="gpu-2", pod="b")))  # another node's
    third = await event_log.append(wrap(ready(node="gpu-1", pod="c")))
    subscription = event_log.subscribe(durable="follows", node="gpu-1")
    one = await next_delivery(subscription)
    assert (one.seq, one.follows) == (first, 0)
    two = await next_delivery(subscription)
    assert (two.seq, two.follows) == (third, first)
    await one.ack()
    await two.nak()
    again = await next_delivery(subscription)
    assert (again.seq, again.follows) == (third, None)
    await again.ack()
    await subscription.aclose()


async def test_garbage_is_delivered_as_undecodable(event_log: EventLog) -> None:
    await event_log.append_raw(f"{prefix_of(event_log)}._.Whatever", b"\x00\x01")
    good = await event_log.append(wrap(ready()))
    subscription = event_log.subscribe(durable="dlq")
    bad = await next_delivery(subscription)
    await bad.ack()
    fine = await next_delivery(subscription)
    await fine.ack()
    await subscription.aclose()
    assert isinstance(bad.entry, Undecodable)
    assert bad.entry.data == b"\x00\x01"
    assert isinstance(fine.entry, StoredEvent)
    assert fine.entry.seq == good


async def test_two_subscribers_of_one_durable_share_its_entries(event_log: EventLog) -> None:
    seqs = [await event_log.append(wrap(ready(pod=f"p{i}"))) for i in range(6)]
    subscriptions = [event_log.subscribe(durable="shared"), event_log.subscribe(durable="shared")]
    seen: list[int] = []
    all_seen = asyncio.Event()

    async def work(subscription: Subscription) -> None:
        async for delivery in subscription:
            seen.append(delivery.entry.seq)
            await delivery.ack()
            if len(seen) >= len(seqs):
                all_seen.set()

    workers = [asyncio.create_task(work(subscription)) for subscription in subscriptions]
    await asyncio.wait_for(all_seen.wait(), timeout=WAIT_S)
    for subscription in subscriptions:
        await subscription.aclose()
    await asyncio.wait_for(asyncio.gather(*workers), timeout=WAIT_S)
    # Each entry to one of them, once: a durable is a work queue, not a broadcast.
    assert sorted(seen) == seqs


# --------------------------------------------------------------------------- lifecycle


async def test_creation_is_idempotent(event_log: EventLog, reopen: Reopen) -> None:
    seq = await event_log.append(wrap(ready()))
    again = await reopen()
    assert await again.last_seq() == seq
    for _ in range(2):
        subscription = again.subscribe(durable="same", node="gpu-1")
        delivery = await next_delivery(subscription)
        assert delivery.entry.seq == seq
        await subscription.aclose()  # not acked: handed back
    with pytest.raises(ValueError, match="exists with filter"):
        await anext(again.subscribe(durable="same", node="another-node"))


async def test_close_is_idempotent_and_ends_the_log(memory_log: InMemoryEventLog) -> None:
    subscription = memory_log.subscribe(durable="d")
    waiting = asyncio.create_task(next_delivery(subscription))
    await memory_log.close()
    await memory_log.close()
    with pytest.raises(EventLogClosed):
        await waiting
    with pytest.raises(EventLogClosed):
        await memory_log.append(wrap(ready()))


async def test_jetstream_close_is_idempotent_and_ends_the_log(
    jetstream_log: JetStreamEventLog,
) -> None:
    for i in range(3):
        await jetstream_log.append(wrap(ready(pod=f"p{i}")))
    subscription = jetstream_log.subscribe(durable="d")
    await next_delivery(subscription)
    replay = jetstream_log.replay()
    await anext(replay)
    await jetstream_log.close()
    await jetstream_log.close()
    with pytest.raises(StopAsyncIteration):
        await anext(subscription)
    with pytest.raises(EventLogClosed):
        await jetstream_log.append(wrap(ready()))
    with pytest.raises(EventLogClosed):
        await anext(replay)


def test_node_tokens() -> None:
    assert node_token("gpu-node-1.example.com") == "gpu-node-1_example_com"
    assert node_token(NODELESS) == "_"
    for bad in ("a b", "a*", "a>", "_"):
        with pytest.raises(ValueError, match="subject token"):
            node_token(bad)


def test_node_of_subject_inverts_node_token() -> None:
    for node in ("gpu-node-1.example.com", "cn-wulanchabu-c.cr-xxx", "n1"):
        assert node_of_subject(f"gpupool.log.{node_token(node)}.PodReady") == node
    assert node_of_subject("gpupool.log._.MessageRejected") is None
    assert node_of_subject("garbage") is None
