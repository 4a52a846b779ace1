"""A decision's publish is framed from lines kept per node and expectation: the subject and
headers are byte for byte what ``header_block`` and ``entry_subject`` make from scratch."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import pytest

from gpupool.eventlog.jetstream import JetStreamEventLog
from gpupool.eventlog.port import entry_subject
from gpupool.eventlog.subjects import node_subject_filter, subject_for, writer_subject_filter
from gpupool.eventlog.wire import PubAck, header_block
from gpupool.events import (
    Assigned,
    Envelope,
    MessageRejected,
    PodRef,
    encode_entry,
    encode_envelope,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


class Capturing(JetStreamEventLog):
    def __init__(self) -> None:  # no connection: _publish is captured
        self.stream, self.subject_prefix, self.writer = "GPUPOOL", "gpupool.log", "admission-queue"
        self._closed = False
        self._appended: dict[str, int] = {}
        self._framing: Any = {}
        self.published: list[tuple[str, bytes, bytes]] = []

    async def _publish(self, subject: str, data: bytes, headers: bytes, **_: Any) -> PubAck:
        self.published.append((subject, data, headers))
        return PubAck(stream=self.stream, seq=len(self.published))


def assigned(node: str, name: str) -> Envelope:
    event = Assigned(pod=PodRef(namespace="ns", name=name), node=node, gpu_index=0, gpu_uuid="G")
    return Envelope(id=f"{node}-{name}", time=T0, event=event)


def expected_headers(
    log: JetStreamEventLog, envelope: Envelope, seq: int | None, filter_: str | None
) -> bytes:
    pairs = [(b"Nats-Msg-Id", envelope.id), (b"Nats-Expected-Stream", log.stream)]
    if seq is not None:
        assert filter_ is not None
        pairs += [
            (b"Nats-Expected-Last-Subject-Sequence", str(seq)),
            (b"Nats-Expected-Last-Subject-Sequence-Subject", filter_),
        ]
    return header_block(pairs)


@pytest.mark.parametrize("node", ["gpu-node-1", "node.with.dots"])
async def test_a_decisions_framing_is_what_header_block_makes_from_scratch(node: str) -> None:
    log = Capturing()
    one, two = assigned(node, "a"), assigned(node, "b")
    await log.append_decision([one], expected_node_seq=7, expected_writer="admission-queue")
    await log.append_decision([one, two], expected_node_seq=12)
    await log.append_decision([two])
    log.stream = "OTHER"  # a changed stream is framed anew, not from the kept lines
    await log.append_decision([two], expected_node_seq=3, expected_writer="admission-queue")
    subject = entry_subject([one], prefix="gpupool.log", writer="admission-queue")
    by_writer = writer_subject_filter("admission-queue", node, prefix="gpupool.log")
    node_wide = node_subject_filter(node, prefix="gpupool.log")
    other = Capturing()
    other.stream = "OTHER"
    assert log.published == [
        (subject, encode_envelope(one), expected_headers(Capturing(), one, 7, by_writer)),
        (subject, encode_entry([one, two]), expected_headers(Capturing(), one, 12, node_wide)),
        (subject, encode_envelope(two), expected_headers(Capturing(), two, None, None)),
        (subject, encode_envelope(two), expected_headers(other, two, 3, by_writer)),
    ]


async def test_a_decision_for_two_nodes_is_refused() -> None:
    with pytest.raises(ValueError, match="one node"):
        await Capturing().append_decision([assigned("n1", "a"), assigned("n2", "b")])


class ImmediateMux:
    """Captures the pipelined publishes; every one is answered at once."""

    def __init__(self) -> None:
        self.submitted: list[tuple[bytes, bytes, bytes]] = []

    async def submit(self, subject: bytes, payload: bytes, headers: bytes) -> Any:
        self.submitted.append((subject, payload, headers))
        future = asyncio.get_running_loop().create_future()
        future.set_result(b'{"stream": "GPUPOOL", "seq": %d}' % len(self.submitted))
        return future


async def test_pipelined_appends_are_framed_as_header_block_and_subject_for_make_them() -> None:
    log = Capturing()
    mux = log._mux = ImmediateMux()  # type: ignore[assignment]
    rejected = MessageRejected(subject="x", reason="unreadable", payload="")
    envelopes = [
        assigned("gpu-node-1", "a"),
        assigned("node.with.dots", "b"),
        Envelope(id="nodeless", time=T0, event=rejected),
        assigned("gpu-node-1", "c"),
    ]
    assert await log.append_many(envelopes) == [1, 2, 3, 4]
    assert mux.submitted == [
        (
            subject_for(e.event, prefix="gpupool.log", writer="admission-queue").encode(),
            encode_envelope(e),
            header_block([(b"Nats-Msg-Id", e.id), (b"Nats-Expected-Stream", "GPUPOOL")]),
        )
        for e in envelopes
    ]
