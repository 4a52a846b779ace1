"""What only the real JetStream adapter can show: separate connections and processes,
ack-wait redelivery after a crash, a server restart, and the nats-server launcher."""

from __future__ import annotations

import asyncio
import socket
import sys
from datetime import UTC, datetime
from itertools import count
from pathlib import Path
from typing import Any

import pytest
from log_streams import acked_up_to

from gpupool.eventlog import ConcurrencyConflict, JetStreamEventLog, StoredEvent
from gpupool.eventlog.nats_server import NatsServerError, nats_server_process, run_nats_server
from gpupool.eventlog.wire import ack_frame
from gpupool.events import Assigned, Envelope, Event, PodReady, PodRef

pytestmark = pytest.mark.integration

WAIT_S = 20.0
_ids = count(1)


def wrap(event: Event) -> Envelope:
    return Envelope(id=f"it-{next(_ids)}", time=datetime(2025, 1, 1, tzinfo=UTC), event=event)


def ready(node: str, pod: str) -> PodReady:
    return PodReady(pod=PodRef(namespace="default", name=pod), node=node)


def assigned(node: str, pod: str) -> Assigned:
    return Assigned(pod=PodRef(namespace="default", name=pod), node=node, gpu_index=0, gpu_uuid="G")


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def accepts_connections(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


async def test_writers_on_two_connections_never_both_win(
    jetstream_log: JetStreamEventLog, nats_url: str
) -> None:
    other = await JetStreamEventLog.connect(
        nats_url, stream=jetstream_log.stream, subject_prefix=jetstream_log.subject_prefix
    )
    try:
        base = await jetstream_log.append(wrap(ready("n.1", "first")), expected_node_seq=0)
        for round_ in range(20):
            # Different tags: different subjects, one node wildcard.
            results = await asyncio.gather(
                jetstream_log.append(wrap(ready("n.1", f"a{round_}")), expected_node_seq=base),
                other.append(wrap(assigned("n.1", f"b{round_}")), expected_node_seq=base),
                return_exceptions=True,
            )
            won = [r for r in results if isinstance(r, int)]
            assert len(won) == 1, results
            assert sum(isinstance(r, ConcurrencyConflict) for r in results) == 1, results
            base = won[0]
        entries = [e async for e in other.replay(node="n.1")]
        assert len(entries) == 21
    finally:
        await other.close()


HOLD_WITHOUT_ACK = """
import asyncio, sys
from gpupool.eventlog import JetStreamEventLog

async def main(url, stream, prefix):
    log = await JetStreamEventLog.connect(url, stream=stream, subject_prefix=prefix, ack_wait=1.0)
    delivery = await anext(log.subscribe(durable="crashy"))
    print(delivery.entry.seq, flush=True)
    await asyncio.Event().wait()  # hold it and never ack, until killed

asyncio.run(main(*sys.argv[1:]))
"""


async def test_an_entry_held_by_a_killed_subscriber_comes_back_after_the_ack_wait(
    jetstream_log: JetStreamEventLog, nats_url: str
) -> None:
    seq = await jetstream_log.append(wrap(ready("n", "p")))
    holder = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        HOLD_WITHOUT_ACK,
        nats_url,
        jetstream_log.stream,
        jetstream_log.subject_prefix,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None
        line = await asyncio.wait_for(holder.stdout.readline(), timeout=WAIT_S)
        assert int(line) == seq
    finally:
        holder.kill()
        await holder.wait()

    subscription = jetstream_log.subscribe(durable="crashy")
    delivery = await asyncio.wait_for(anext(subscription), timeout=WAIT_S)
    assert delivery.entry.seq == seq
    await delivery.ack()
    await subscription.aclose()


async def test_appends_and_subscriptions_survive_a_server_restart(tmp_path: Path) -> None:
    store = tmp_path / "store"
    async with run_nats_server(store) as url:
        log = await JetStreamEventLog.connect(url)
        first = await log.append(wrap(ready("n", "before")))
        subscription = log.subscribe(durable="survivor")
        delivery = await asyncio.wait_for(anext(subscription), timeout=WAIT_S)
        await delivery.ack()
    assert not accepts_connections(port_of(url))
    try:
        # The server is down: the append waits (retrying) until it is back.
        pending = asyncio.create_task(log.append(wrap(ready("n", "during"))))
        waiting = asyncio.create_task(anext(subscription))
        async with run_nats_server(store, port=port_of(url)):
            second = await asyncio.wait_for(pending, timeout=WAIT_S)
            delivery = await asyncio.wait_for(waiting, timeout=WAIT_S)
            assert delivery.entry.seq == second
            await delivery.ack()
            entries = [e async for e in log.replay()]
            assert [e.seq for e in entries] == [first, second] == [1, 2]
            assert all(isinstance(e, StoredEvent) for e in entries)
            await log.close()
    finally:
        await log.close()


async def test_fatal_lines_of_a_server_that_cannot_start_are_in_the_error(
    tmp_path: Path, nats_url: str
) -> None:
    with pytest.raises(NatsServerError, match=r"\[FTL\].*address already in use"):
        async with run_nats_server(tmp_path / "second", port=port_of(nats_url)):
            pass


async def test_the_async_server_stops_on_exit(tmp_path: Path) -> None:
    async with run_nats_server(tmp_path) as url:
        assert url.startswith("nats://127.0.0.1:")
        assert accepts_connections(port_of(url))
    assert not accepts_connections(port_of(url))


def test_the_blocking_server_stops_on_exit(tmp_path: Path) -> None:
    with nats_server_process(tmp_path) as url:
        assert accepts_connections(port_of(url))
    assert not accepts_connections(port_of(url))


async def test_connect_gives_up_when_no_server_answers(tmp_path: Path) -> None:
    async with run_nats_server(tmp_path) as url:
        pass  # a port that was just in use and is free now
    with pytest.raises(ConnectionError, match="no NATS server answered"):
        await JetStreamEventLog.connect(url, connect_timeout=1.0)


async def test_pipelined_append_many_across_windows_then_filtered_replay(
    jetstream_log: JetStreamEventLog,
) -> None:
    batch = [wrap(ready(f"node-{i % 3}", f"p{i}")) for i in range(2500)]

    seqs = await jetstream_log.append_many(batch)
    # Half of it again (a retried batch): deduplicated, same seqs.
    again = await jetstream_log.append_many(batch[1000:2250])

    assert seqs == list(range(1, 2501))
    assert again == seqs[1000:2250]
    node_1 = [e async for e in jetstream_log.replay(node="node-1", from_seq=100)]
    assert [e.seq for e in node_1] == [s for s in seqs if s >= 100 and (s - 1) % 3 == 1]
    assert all(isinstance(e, StoredEvent) and e.envelope.event.node == "node-1" for e in node_1)


async def take_all(subscription: Any, count: int) -> list[Any]:
    """``count`` deliveries of ``subscription``, as the consume loop takes them (batches)."""
    taken = [await asyncio.wait_for(anext(subscription), timeout=WAIT_S)]
    while len(taken) < count:
        taken += subscription.take_ready(count) or [
            await asyncio.wait_for(anext(subscription), timeout=WAIT_S)
        ]
    return taken


async def test_a_batch_acked_in_one_write_is_acknowledged_entry_by_entry(
    jetstream_log: JetStreamEventLog,
) -> None:
    seqs = [await jetstream_log.append(wrap(ready("n", f"p{i}"))) for i in range(6)]
    subscription = jetstream_log.subscribe(durable="batch-acked")
    taken = await take_all(subscription, len(seqs))
    assert [delivery.seq for delivery in taken] == seqs
    await taken[1].ack()  # acked before: not acked twice
    await subscription.ack_many(taken)
    await subscription.aclose()  # would nak anything still held
    info = await acked_up_to(jetstream_log, subscription.durable, seqs[-1], within_s=WAIT_S)
    assert info.num_ack_pending == 0
    later = await jetstream_log.append(wrap(ready("n", "later")))
    again = jetstream_log.subscribe(durable="batch-acked")
    try:
        first = await asyncio.wait_for(anext(again), timeout=WAIT_S)
        assert first.seq == later  # none of the batch came back
        await first.ack()
    finally:
        await again.aclose()


async def test_a_batch_whose_ack_write_fails_stays_unacked_and_is_acked_later(
    jetstream_log: JetStreamEventLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpupool.eventlog import jetstream as jetstream_module

    seqs = [await jetstream_log.append(wrap(ready("n", f"q{i}"))) for i in range(3)]
    subscription = jetstream_log.subscribe(durable="batch-ack-fails")
    taken = await take_all(subscription, len(seqs))
    written = jetstream_module.send_frame

    async def failing(*args: object, **kwargs: object) -> None:
        raise ConnectionError("the connection went away")

    monkeypatch.setattr(jetstream_module, "send_frame", failing)
    with pytest.raises(ConnectionError):
        await subscription.ack_many(taken)
    monkeypatch.setattr(jetstream_module, "send_frame", written)
    try:
        # still this subscription's, not acked: acking them again now sends their acks
        assert sorted(d.seq for d in subscription._unacked.values()) == seqs
        await subscription.ack_many(taken)
        assert subscription._unacked == {}
        await acked_up_to(jetstream_log, subscription.durable, seqs[-1], within_s=WAIT_S)
    finally:
        await subscription.aclose()


@pytest.mark.parametrize("now", [True, False])
async def test_a_batch_acked_now_is_written_in_the_acking_step_else_left_to_the_flusher(
    jetstream_log: JetStreamEventLog, now: bool
) -> None:
    seqs = [await jetstream_log.append(wrap(ready("n", f"w{i}"))) for i in range(3)]
    subscription = jetstream_log.subscribe(durable=f"batch-acked-now-{now}")
    taken = await take_all(subscription, len(seqs))
    try:
        await subscription.ack_many(taken, now=now)
        # nothing suspended since the call: the flusher has not had a turn
        left = list(jetstream_log._nc._pending)
        info = await acked_up_to(jetstream_log, subscription.durable, seqs[-1], within_s=WAIT_S)
    finally:
        await subscription.aclose()
    assert left == ([] if now else [b"".join(ack_frame(d._reply) for d in taken)])
    assert info.num_ack_pending == 0


async def test_a_pipelined_append_that_fails_leaves_no_publish_waiting_for_its_puback(
    jetstream_log: JetStreamEventLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    mux = jetstream_log._mux
    submit = mux.submit
    calls = count(1)

    async def failing_in_the_second_window(*args: Any, **kwargs: Any) -> Any:
        if next(calls) == 1500:  # the first window in flight, half the second sent
            raise ConnectionError("the connection went away")
        return await submit(*args, **kwargs)

    monkeypatch.setattr(mux, "submit", failing_in_the_second_window)
    with pytest.raises(ConnectionError):
        await jetstream_log.append_many([wrap(ready("n", f"w{i}")) for i in range(2500)])
    # every publish it had sent is given up: none holds a lone append back (submit's now)
    assert mux.in_flight == 0
