"""Projection rebuild: 1,000,000 log entries folded from zero and resumed from a snapshot, against
the raw decode-only speed of the same entries in the same run.

    .venv/bin/python bench/bench_rebuild.py [N] [--decision-share F] [--skip-jetstream]

The log is made by the core simulator: a few template nodes, each simulated on its own
(ready/complete/cancel/fail/oom, preemption by priority and by max duration, requeue),
then cloned under new node, namespace and id names until there are N entries (nodes are
independent, so every clone is a valid history). Entries are JSON-encoded envelopes,
held in memory for the first table; the second table puts the same entries in a real
JetStream stream (nats-server started here) and measures, in the same run, the raw
replay of that stream (nats-py's ordered consumer counting messages in a callback: the
issue's baseline; and raw pulls into a LogClient sink counting them: the transport the
rebuild now reads through) against a service's rebuild from it (``DeciderLoop.rebuild``:
replay, decode, fold) from zero and from the snapshot. The rebuild keeps statistics
(metrics_projection), as the admission-queue service does.

A third table restarts a service (a DeciderLoop, as every service runs, its log connected
with a claimant) on the full stream, from a snapshot taken at its end and from zero, with
its durable slot left behind by the instance before having acknowledged nothing: the time
until it reacts to a live entry, and how many messages its durable slots delivered (1: the
live entry only; no folded entry is delivered a second time).

``--decision-share F`` (default 0: every entry one envelope, the runs before it had): about
F of the envelopes are written in decision entries (``encode_entry`` of 2 or 3 envelopes,
each with the same node's next ones; seeded), the entries a decision of several events
appends, so that the replay's batch decode (``decode_plain_many``, split around decision
entries) and the fold of entries of several envelopes are measured on a log with many of
them. The "entries" columns then count log entries, fewer than the N envelopes.

Runs on older code too (its ``libs/*/src`` first on ``PYTHONPATH``) for an A/B in turn.

Prints tables; no assertions (the numbers depend on the machine), except that the
resumed projection equals the one rebuilt from zero.
"""

from __future__ import annotations

import asyncio
import gc
import heapq
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import suppress
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import nats
import nats.js.errors
from nats.aio.msg import Msg

from gpupool.core.simulation import (
    ActionKind,
    Scenario,
    ScenarioAction,
    ScenarioNode,
    ScenarioPod,
    ScenarioShare,
    simulate,
)
from gpupool.eventlog import (
    InMemoryEventLog,
    JetStreamEventLog,
    StoredEvent,
    pulled_replay,
    subject_for,
)
from gpupool.eventlog.durables import durable_names
from gpupool.eventlog.log_client import LogClient
from gpupool.eventlog.nats_server import run_nats_server
from gpupool.eventlog.port import Undecodable, read_batch
from gpupool.eventlog.pulled_replay import _delivered as replay_sequences
from gpupool.events import (
    Envelope,
    MessageRejected,
    decode_entry,
    decode_envelope,
    encode_entry,
    encode_envelope,
    event_node,
)
from gpupool.observability import (
    Projection,
    decode_snapshot,
    encode_snapshot,
    metrics_projection,
)
from gpupool.runtime.decider import DeciderLoop, collection_paused

TEMPLATES = 12
PODS_PER_NODE = 24
ACTIONS_PER_POD = 120
TOKEN = b"-r000"
SNAPSHOT_AT = 0.9


def template_scenario(index: int) -> Scenario:
    rng = random.Random(index)
    name = f"node-{index:02d}-r000"
    node = ScenarioNode(
        name=name,
        gpus=rng.choice([8, 16]),
        qos='{"preemptEnabled": true, "podMaxDurationMinutes": 10}',
    )
    pods: list[ScenarioPod] = []
    timeline: list[ScenarioAction] = []
    for p in range(PODS_PER_NODE):
        limit = rng.choice([25, 50, 50, 100])
        pod = ScenarioPod(
            name=f"pod-{p}",
            namespace=f"ns-{index:02d}-r000",
            node=name,
            requests=ScenarioShare(core=min(limit, 30), memory=min(limit, 30)),
            limits=ScenarioShare(core=limit, memory=limit),
            priority=rng.choice([0, 0, 0, 100]),
            requeue=rng.random() < 0.2,
        )
        pods.append(pod)
        at = 0.0
        for _ in range(ACTIONS_PER_POD):
            at += rng.expovariate(1 / 400)
            if rng.random() < 0.85:
                timeline.append(
                    ScenarioAction(
                        at=at,
                        action="ready",
                        pod=pod.name,
                        namespace=pod.namespace,
                        runs_for=rng.expovariate(1 / 300),
                    )
                )
            else:
                kind: ActionKind = rng.choice(["cancel", "fail", "oom"])
                timeline.append(
                    ScenarioAction(at=at, action=kind, pod=pod.name, namespace=pod.namespace)
                )
    return Scenario(nodes=[node], pods=pods, timeline=timeline)


def template_logs() -> list[list[tuple[datetime, int, int, bytes]]]:
    logs = []
    for index in range(TEMPLATES):
        log = simulate(template_scenario(index))
        logs.append(
            [
                (
                    envelope.time,
                    index,
                    position,
                    encode_envelope(
                        msgspec.structs.replace(envelope, id=f"node-{index:02d}-r000-{position}")
                    ),
                )
                for position, envelope in enumerate(log)
            ]
        )
    return logs


def cloned_log(n: int) -> tuple[list[bytes], int, int]:
    """N encoded envelopes; also the template entry count and the number of clones per template."""
    templates = template_logs()
    template_entries = sum(len(log) for log in templates)
    clones = -(-n // template_entries)
    out: list[bytes] = []
    for _, _, _, data in heapq.merge(*templates):
        for clone in range(clones):
            out.append(data.replace(TOKEN, b"-r%03d" % clone))
        if len(out) >= n:
            break
    return out[:n], template_entries, clones


def with_decision_entries(encoded: list[bytes], share: float) -> list[bytes]:
    """The same envelopes, about ``share`` of them in decision entries of 2 or 3: an envelope
    picked (seeded) is written with its node's next one or two (taken out of their places:
    nodes are independent, so the log stays a valid history)."""
    if share <= 0:
        return encoded
    rng = random.Random(20261202)
    envelopes = [decode_envelope(data) for data in encoded]
    nodes = [event_node(envelope.event) for envelope in envelopes]
    following: list[int | None] = [None] * len(envelopes)
    last_of: dict[str, int] = {}
    for index in range(len(envelopes) - 1, -1, -1):
        following[index] = last_of.get(nodes[index])
        last_of[nodes[index]] = index
    taken = [False] * len(envelopes)
    # a group of k envelopes starts at a picked one: P(start) * mean k = share
    start = share / (2.5 - 1.5 * share)
    out: list[bytes] = []
    for index in range(len(envelopes)):
        if taken[index]:
            continue
        group = [index]
        if rng.random() < start:
            size = rng.choice((2, 3))
            after = following[index]
            while after is not None and len(group) < size:
                if not taken[after]:
                    group.append(after)
                    taken[after] = True
                after = following[after]
        if len(group) == 1:
            out.append(encoded[index])
        else:
            out.append(encode_entry([envelopes[member] for member in group]))
    return out


def decision_share(argv: list[str]) -> float:
    if "--decision-share" not in argv:
        return 0.0
    return float(argv[argv.index("--decision-share") + 1])


class Timing:
    """Wall-clock and CPU seconds (on a shared machine other processes inflate wall-clock time,
    not the CPU time of this one)."""

    def __init__(self, wall: float, cpu: float) -> None:
        self.wall = wall
        self.cpu = cpu


def timed(work: Callable[[], object]) -> tuple[Timing, object]:
    gc.collect()
    start, start_cpu = time.perf_counter(), time.process_time()
    result = work()
    return Timing(time.perf_counter() - start, time.process_time() - start_cpu), result


def fold_plain(projection: Projection, entries: Iterator[tuple[int, bytes]]) -> Projection:
    apply = projection.apply
    for seq, data in entries:
        apply(seq, decode_envelope(data))
    return projection


def fold_mixed(projection: Projection, entries: Iterator[tuple[int, bytes]]) -> Projection:
    """``fold`` of a log holding decision entries (``--decision-share``)."""
    apply = projection.apply
    for seq, data in entries:
        if data.startswith(b'{"envelopes":'):
            fold_entry(projection, seq, decode_entry(data))
        else:
            apply(seq, decode_envelope(data))
    return projection


def fold_entry(projection: Projection, seq: int, envelopes: tuple[Envelope, ...]) -> None:
    last = len(envelopes) - 1
    for index, envelope in enumerate(envelopes):
        projection.apply(seq, envelope, index=index, last=index == last)


def fold_decoded(decoded: list[Envelope | tuple[Envelope, ...]]) -> Projection:
    projection = metrics_projection()
    apply = projection.apply
    for seq, envelope in enumerate(decoded, start=1):
        if isinstance(envelope, tuple):
            fold_entry(projection, seq, envelope)
        else:
            apply(seq, envelope)
    return projection


READ_CHUNK: int = getattr(pulled_replay, "READ_CHUNK", 1024)
"""Deliveries a replay reads (decodes) at a time: on code before READ_CHUNK, a pull's whole."""

Delivery = tuple[bytes, bytes, bytes]
"""(subject, reply subject, payload): a replay's delivery as the frame parser hands it over."""


def delivered_batches(encoded: list[bytes], size: int = 1024) -> list[list[Delivery]]:
    """The entries as a replay's pulls deliver them (JetStream's reply subjects), in batches."""
    count = len(encoded)
    deliveries = [
        (
            subject_for(decode_entry(data)[0].event).encode(),
            b"$JS.ACK.GPUPOOL.bench-replay.1.%d.%d.1764700000000000000.%d"
            % (seq, seq, count - seq),
            data,
        )
        for seq, data in enumerate(encoded, start=1)
    ]
    return [deliveries[offset : offset + size] for offset in range(0, count, size)]


def read_and_fold(
    batches: list[list[Delivery]], chunk: int = READ_CHUNK
) -> tuple[Timing, Timing, Projection]:
    """What a replay does with each pull's deliveries (their sequences from the reply
    subjects, their subjects decoded once each, in ``next_batch``; then ``chunk`` entries
    at a time read, ``read_batch``, in ``pulled_batches``), and the rebuild's fold of each
    chunk read (``DeciderLoop._fold_ordered``) before the next is read, as a rebuild goes
    (each part let go once read, as ``pulled_replay`` does); the CPU of the two stages
    summed apart. Each pull's deliveries are put in the inbox's three lists untimed (the
    reader loop appends them so)."""
    loop = DeciderLoop(InMemoryEventLog(), service="bench", projection=metrics_projection())
    unreadable: list[Undecodable] = []
    expected = 1
    subjects: dict[bytes, str] = {}
    read_wall = read_cpu = fold_wall = fold_cpu = 0.0
    for batch in batches:
        subject_bytes, replies, datas = (list(column) for column in zip(*batch, strict=True))
        start, start_cpu = time.perf_counter(), time.process_time()
        seqs, gap = replay_sequences(replies, expected)
        replies.clear()
        assert gap is None and len(seqs) == len(batch)
        expected += len(seqs)
        for subject in set(subject_bytes).difference(subjects):
            subjects[subject] = subject.decode()
        texts = list(map(subjects.__getitem__, subject_bytes))
        subject_bytes.clear()
        read_wall += time.perf_counter() - start
        read_cpu += time.process_time() - start_cpu
        for at in range(0, len(seqs), chunk):
            start, start_cpu = time.perf_counter(), time.process_time()
            chunk_datas = datas[:chunk]
            del datas[:chunk]
            entries = read_batch(seqs[at : at + chunk], texts[at : at + chunk], chunk_datas)
            del chunk_datas
            read, read_at = time.perf_counter(), time.process_time()
            loop._fold_ordered(entries, unreadable)
            read_wall += read - start
            read_cpu += read_at - start_cpu
            fold_wall += time.perf_counter() - read
            fold_cpu += time.process_time() - read_at
    assert not unreadable
    return Timing(read_wall, read_cpu), Timing(fold_wall, fold_cpu), loop.projection


def read_replies(batches: list[list[Delivery]]) -> None:
    expected = 1
    for batch in batches:
        seqs, _ = replay_sequences([reply for _, reply, _ in batch], expected)
        expected += len(seqs)


def decode_one(data: bytes) -> Envelope | tuple[Envelope, ...]:
    if data.startswith(b'{"envelopes":'):
        return decode_entry(data)
    return decode_envelope(data)


def main(n: int, share: float = 0.0) -> None:
    start = time.perf_counter()
    encoded, template_entries, clones = cloned_log(n)
    encoded = with_decision_entries(encoded, share)
    generated = time.perf_counter() - start
    print(
        f"log: {len(encoded):,} entries ({sum(map(len, encoded)) / len(encoded):.0f} B each): "
        f"{TEMPLATES} simulated template nodes ({template_entries:,} entries) x {clones} clones "
        f"= {TEMPLATES * clones} nodes; generated in {generated:.1f} s"
    )
    if share > 0:
        decisions = sum(data.startswith(b'{"envelopes":') for data in encoded)
        print(
            f"decision entries: {decisions:,} of {len(encoded):,} entries "
            f"({decisions / len(encoded):.0%}), holding {n - (len(encoded) - decisions):,} of "
            f"{n:,} envelopes ({(n - (len(encoded) - decisions)) / n:.0%})"
        )
    cut = int(len(encoded) * SNAPSHOT_AT)

    decode: Callable[[bytes], Envelope | tuple[Envelope, ...]] = (
        decode_one if share > 0 else decode_envelope
    )
    fold = fold_mixed if share > 0 else fold_plain

    def decode_all() -> None:
        for data in encoded:
            decode(data)

    decode_s, _ = timed(decode_all)
    decoded = [decode(data) for data in encoded]
    gc.freeze()  # a million live envelopes would otherwise make every collection walk them

    fold_only_s, _ = timed(lambda: fold_decoded(decoded))
    decoded.clear()
    gc.unfreeze()
    zero_s, from_zero = timed(lambda: fold(metrics_projection(), enumerate(encoded, start=1)))
    assert isinstance(from_zero, Projection)

    head = fold(metrics_projection(), enumerate(encoded[:cut], start=1))
    take_s, snapshot = timed(lambda: encode_snapshot(head.to_snapshot()))
    assert isinstance(snapshot, bytes)

    def resume() -> Projection:
        projection = Projection.from_snapshot(decode_snapshot(snapshot))
        return fold(projection, enumerate(encoded[cut:], start=cut + 1))

    resume_s, resumed = timed(resume)
    restore_s, _ = timed(lambda: Projection.from_snapshot(decode_snapshot(snapshot)))
    assert isinstance(resumed, Projection)
    assert resumed.state == from_zero.state
    assert resumed.statistics == from_zero.statistics
    assert resumed.last_seq == from_zero.last_seq == len(encoded)

    total = len(encoded)
    deliveries = delivered_batches(encoded)
    gc.collect()
    with collection_paused():  # as in a rebuild
        read_s, fold_read_s, folded = read_and_fold(deliveries)
        replies_s, _ = timed(lambda: read_replies(deliveries))
    assert folded.state == from_zero.state
    deliveries.clear()  # (not held through the rows after)
    rows = [
        ("decode only (JSON -> Envelope)", total, decode_s),
        ("fold only (pre-decoded, with statistics)", total, fold_only_s),
        ("rebuild from zero (decode + fold)", total, zero_s),
        (f"a replay's read ({READ_CHUNK} of a pull's 1,024 at a time)", total, read_s),
        ("  of which: the reply subjects alone", total, replies_s),
        ("a replay's fold of each chunk read", total, fold_read_s),
        (f"resume from snapshot at {SNAPSHOT_AT:.0%} (load + rest)", total - cut, resume_s),
        ("  of which: load the snapshot", 0, restore_s),
        ("take the snapshot (encode)", 0, take_s),
    ]
    print(
        f"snapshot: {len(snapshot) / 1e6:.2f} MB at sequence {cut:,}; "
        f"{len(from_zero.state.pods):,} pods"
    )
    print()
    print(
        f"{'phase':<48} {'entries':>10} {'wall s':>8} {'cpu s':>8} {'entries/cpu-s':>14} "
        f"{'x decode':>9}"
    )
    for name, entries, timing in rows:
        rate = f"{entries / timing.cpu:,.0f}" if entries else "-"
        print(
            f"{name:<48} {entries:>10,} {timing.wall:>8.3f} {timing.cpu:>8.3f} {rate:>14} "
            f"{timing.cpu / decode_s.cpu:>9.2f}"
        )
    print()
    print(f"rebuild from zero / decode only (cpu): {zero_s.cpu / decode_s.cpu:.2f}")
    print(f"resume from snapshot / rebuild from zero (cpu): {resume_s.cpu / zero_s.cpu:.3f}")
    print("resumed projection == projection rebuilt from zero: yes")
    if "--skip-jetstream" not in sys.argv:
        asyncio.run(jetstream_phase(encoded, cut, from_zero, snapshot))


async def jetstream_phase(
    encoded: list[bytes], cut: int, from_zero: Projection, snapshot: bytes
) -> None:
    """The same entries in a JetStream stream: raw replay vs. rebuild from it."""
    with tempfile.TemporaryDirectory(prefix="gpupool-bench-") as tmp:
        async with run_nats_server(Path(tmp)) as url:
            nc = await nats.connect(url)
            js = nc.jetstream()
            await js.add_stream(name="GPUPOOL", subjects=["gpupool.log.>"])
            subjects = [subject_for(decode_entry(data)[0].event) for data in encoded]
            start = time.perf_counter()
            window = 2000
            for offset in range(0, len(encoded), window):
                acks = [
                    await js.publish_async(subject, data)
                    for subject, data in zip(
                        subjects[offset : offset + window],
                        encoded[offset : offset + window],
                        strict=True,
                    )
                ]
                await asyncio.gather(*acks)
            loaded = time.perf_counter() - start
            total = len(encoded)

            raw, raw_cpu = await ordered_consumer_count(js, total)
            await nc.close()
            raw_pull, raw_pull_cpu = await raw_pull_count(url, total)

            log = await JetStreamEventLog.connect(url, claimant="bench-instance")
            gc.collect()
            start, start_cpu = time.perf_counter(), time.process_time()
            zero_loop = DeciderLoop(log, service="bench", projection=metrics_projection())
            await zero_loop.rebuild()
            zero, zero_cpu = time.perf_counter() - start, time.process_time() - start_cpu
            rebuilt = zero_loop.projection
            gc.collect()
            start, start_cpu = time.perf_counter(), time.process_time()
            resumed_loop = DeciderLoop(
                log, service="bench", projection=Projection.from_snapshot(decode_snapshot(snapshot))
            )
            await resumed_loop.rebuild()
            from_snapshot = time.perf_counter() - start
            snapshot_cpu = time.process_time() - start_cpu
            resumed = resumed_loop.projection
            restarts = [
                await restarted_service(
                    log, "snapshot", Projection.from_snapshot(decode_snapshot(snapshot_end))
                )
                for snapshot_end in [encode_snapshot(rebuilt.to_snapshot())]
            ]
            restarts.append(await restarted_service(log, "zero", metrics_projection()))
            await log.close()
    assert rebuilt.state == from_zero.state == resumed.state
    assert rebuilt.statistics == resumed.statistics
    print()
    print(
        f"JetStream (same {total:,} entries, one stream, file storage; loaded in {loaded:.1f} s "
        f"at {total / loaded:,.0f}/s with publish_async)"
    )
    print(
        f"{'phase':<52} {'entries':>10} {'wall s':>8} {'cpu s':>7} {'x raw':>7} "
        f"{'of raw':>7} {'cpu x raw':>9} {'cpu of raw':>10}"
    )
    for name, entries, seconds, cpu in (
        ("raw replay (ordered consumer, count only)", total, raw, raw_cpu),
        ("raw pulls (LogClient sink, 1,024 a pull, count only)", total, raw_pull, raw_pull_cpu),
        ("rebuild from zero (DeciderLoop.rebuild)", total, zero, zero_cpu),
        (f"resume from snapshot at {SNAPSHOT_AT:.0%}", total - cut, from_snapshot, snapshot_cpu),
    ):
        print(
            f"{name:<52} {entries:>10,} {seconds:>8.2f} {cpu:>7.2f} {seconds / raw:>7.2f} "
            f"{raw / seconds:>7.0%} {cpu / raw_cpu:>9.2f} {raw_cpu / cpu:>10.0%}"
        )
    print(
        f"rebuild from zero: {raw / zero:.0%} of the raw ordered-consumer replay's speed "
        f"({raw_cpu / zero_cpu:.0%} in cpu time), {raw_pull / zero:.0%} of raw pulls' "
        f"({raw_pull_cpu / zero_cpu:.0%} in cpu time); {total / zero_cpu:,.0f} entries/cpu-s"
    )
    print("rebuilt from JetStream == resumed from the snapshot == rebuilt in memory: yes")
    print()
    print(
        "restarted service (its durable left behind having acknowledged nothing): from start "
        "to reacting to a live entry"
    )
    print(f"{'restart':<48} {'live after s':>12} {'deliveries':>11} {'replayed again':>15}")
    for how, live_s, delivered in restarts:
        print(f"{'from ' + how:<48} {live_s:>12.3f} {delivered:>11} {delivered - 1:>15}")


async def ordered_consumer_count(js: Any, total: int) -> tuple[float, float]:
    """Seconds (wall, cpu) for nats-py's ordered consumer to deliver ``total`` messages to a
    callback."""
    done = asyncio.Event()
    count = 0

    async def on_msg(msg: Msg) -> None:
        nonlocal count
        count += 1
        if count == total:
            done.set()

    gc.collect()
    start, start_cpu = time.perf_counter(), time.process_time()
    subscription = await js.subscribe("gpupool.log.>", cb=on_msg, ordered_consumer=True)
    await done.wait()
    seconds, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    await subscription.unsubscribe()
    return seconds, cpu


async def raw_pull_count(url: str, total: int) -> tuple[float, float]:
    """Seconds (wall, cpu) to pull ``total`` messages from a consumer without acks into a LogClient sink
    (1,024 a pull, two pulls in flight), counting them: the transport under the rebuild."""
    client = LogClient()
    await client.connect(url)
    try:
        name = "bench-raw-pulls"
        await client.jetstream().add_consumer(
            "GPUPOOL", name=name, ack_policy="none", deliver_policy="all", mem_storage=True
        )
        arrived = 0
        wake = asyncio.Event()

        def sink(subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> None:
            nonlocal arrived
            if headers is None or not headers.startswith(b"NATS/1.0 "):
                arrived += 1
                if arrived % 1024 == 0 or arrived == total:
                    wake.set()

        inbox = client.new_inbox()
        gc.collect()
        start, start_cpu = time.perf_counter(), time.process_time()
        await client.raw_subscribe(inbox, sink)
        requested = 0
        while arrived < total:
            while requested - arrived < 2048 and requested < total:
                batch = min(1024, total - requested)
                await client.publish(
                    f"$JS.API.CONSUMER.MSG.NEXT.GPUPOOL.{name}",
                    json.dumps({"batch": batch, "expires": 5_000_000_000}).encode(),
                    reply=inbox,
                )
                requested += batch
            wake.clear()
            await wake.wait()
        return time.perf_counter() - start, time.process_time() - start_cpu
    finally:
        await client.close()


async def restarted_service(
    log: JetStreamEventLog, how: str, projection: Projection
) -> tuple[str, float, int]:
    """A service restarted from ``projection``: rebuild, subscribe, react to one live entry.

    Its durable slot (claimed by the same instance, as a restarted replica finds it) exists
    from before the restart and acknowledged nothing (the worst case: a rollout right after
    a rebuild from zero). Returns how long until the live entry was reacted to and how many
    messages the instance's durables delivered meanwhile (1: only it).
    """
    assert log.claimant is not None
    durable = f"bench-{how}"
    await log._claim_durable(durable, log.claimant, "gpupool.log.>", 1)  # the one left behind
    delivered_before = await delivered(log, durable)
    start = time.perf_counter()
    loop = DeciderLoop(log, service=f"bench-{how}", projection=projection)
    await loop.rebuild()
    live = asyncio.Event()

    async def react(_: StoredEvent) -> None:
        live.set()

    consumer = asyncio.create_task(loop.consume(durable, react))
    await log.append(
        Envelope(
            id=f"live-{how}-{time.time_ns()}",
            time=datetime.now(UTC),
            event=MessageRejected(subject="bench", reason="a live entry", payload=""),
        )
    )
    await live.wait()
    live_s = time.perf_counter() - start
    consumer.cancel()
    with suppress(asyncio.CancelledError):
        await consumer
    return how, live_s, await delivered(log, durable) - delivered_before


async def delivered(log: JetStreamEventLog, base: str) -> int:
    """Messages delivered by all of ``base``'s durable slots so far."""
    total = 0
    for name in durable_names(base):
        with suppress(nats.js.errors.NotFoundError):
            total += (await log._js.consumer_info(log.stream, name)).delivered.consumer_seq or 0
    return total


if __name__ == "__main__":
    sizes = [int(arg) for arg in sys.argv[1:] if arg.isdigit()]
    main(sizes[0] if sizes else 1_000_000, decision_share(sys.argv))
