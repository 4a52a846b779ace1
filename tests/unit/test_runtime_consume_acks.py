"""When the consume loop's acks go to the socket: a batch acked after its reactions (its
last frames) is written in the consume step, not left for the connection's flusher; a
batch acked before its reactions (the admission-queue) leaves its acks queued, so the
decisions that follow in the same step go to the socket with them."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import pytest

from gpupool.eventlog import InMemoryEventLog, StoredEvent
from gpupool.eventlog.port import Delivery
from gpupool.eventlog.subjects import subject_for
from gpupool.events import Envelope, NodeConfigured, QosConfig, encode_envelope
from gpupool.runtime.decider import DeciderLoop

NOW = datetime(2025, 1, 1, tzinfo=UTC)
WAIT_S = 10.0


class RecordedAcks:
    """A subscription of the in-memory log whose ``ack_many`` calls are noted (in order,
    with what was reacted to before each)."""

    def __init__(self, inner: Any, reacted: list[int], acked: asyncio.Event) -> None:
        self._inner = inner
        self._reacted = reacted
        self.calls: list[tuple[list[int], bool, int]] = []
        """(the sequences acked, ``now``, how many reactions ran before)"""
        self.acked = acked

    def __aiter__(self) -> RecordedAcks:
        return self

    async def __anext__(self) -> Delivery:
        delivery: Delivery = await self._inner.__anext__()
        return delivery

    def take_ready(self, limit: int) -> list[Delivery]:
        taken: list[Delivery] = self._inner.take_ready(limit)
        return taken

    def react_on_arrival(self, hook: Any) -> bool:
        accepted: bool = self._inner.react_on_arrival(hook)
        return accepted

    async def ack_many(self, deliveries: Sequence[Delivery], *, now: bool = False) -> None:
        self.calls.append(([d.seq for d in deliveries], now, len(self._reacted)))
        await self._inner.ack_many(deliveries, now=now)
        self.acked.set()

    async def aclose(self) -> None:
        await self._inner.aclose()


async def consumed_once(
    *, ack_before_reacting: bool
) -> tuple[list[tuple[list[int], bool, int]], int]:
    """One entry consumed by a loop: its subscription's ack calls, and the entry's sequence."""
    log = InMemoryEventLog(writer="policy")
    loop = DeciderLoop(log, service="policy", clock=lambda: NOW)
    await loop.rebuild()
    reacted: list[int] = []
    subscriptions: list[RecordedAcks] = []
    acked = asyncio.Event()
    subscribe = log.subscribe

    def recorded(**options: Any) -> RecordedAcks:
        subscriptions.append(RecordedAcks(subscribe(**options), reacted, acked))
        return subscriptions[-1]

    log.subscribe = recorded  # type: ignore[method-assign]
    event = NodeConfigured(node="a", policy="share-pool", qos=QosConfig(), gpu_count=1)
    subject = subject_for(event, prefix=log.subject_prefix, writer="policy")
    seq = await log.append_raw(
        subject, encode_envelope(Envelope(id=uuid.uuid4().hex, time=NOW, event=event))
    )

    async def react(entry: StoredEvent) -> None:
        reacted.append(entry.seq)

    consumer = asyncio.create_task(
        loop.consume("acks", react, ack_before_reacting=ack_before_reacting)
    )
    try:
        async with asyncio.timeout(WAIT_S):
            await acked.wait()
    finally:
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)
    return subscriptions[0].calls, seq


@pytest.mark.parametrize("ack_before_reacting", [False, True])
async def test_the_consume_loop_writes_its_acks_now_only_when_nothing_follows_them(
    ack_before_reacting: bool,
) -> None:
    calls, seq = await consumed_once(ack_before_reacting=ack_before_reacting)

    assert calls[0][0] == [seq]
    if ack_before_reacting:
        assert calls[0][1:] == (False, 0)  # queued before the reaction: its frames follow
    else:
        assert calls[0][1:] == (True, 1)  # after the reaction: the batch's last frames
