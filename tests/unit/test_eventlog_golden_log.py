"""A fixed log written by every entry format gpupool has had, read by today's code.

tests/golden/log/v1-v2-v3.jsonl holds one raw log entry per line: version-2
envelopes, version-1 envelopes (fractions, no gpu_uuid: upcast on read) and a
version-3 decision entry (two Assigned committed as one entry). It is a fixed
file: if this test fails, an old log can no longer be read.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpupool.core import fold
from gpupool.eventlog import InMemoryEventLog, StoredEvent, read_entries
from gpupool.events import (
    ENTRY_SCHEMA_VERSION,
    Assigned,
    Envelope,
    EventDecodeError,
    PodRef,
    PodRegistered,
    Share,
    decode_entry,
    encode_entry,
)

GOLDEN_LOG = Path(__file__).resolve().parents[1] / "golden" / "log" / "v1-v2-v3.jsonl"
DEMO = PodRef(namespace="default", name="gpu-share-demo")
OLD = PodRef(namespace="default", name="gpu-share-old")


def lines() -> list[bytes]:
    return GOLDEN_LOG.read_bytes().splitlines()


def test_every_entry_of_the_golden_log_is_read() -> None:
    per_entry = [decode_entry(line) for line in lines()]
    assert [len(envelopes) for envelopes in per_entry] == [1, 1, 1, 1, 1, 1, 2]
    registered = per_entry[2][0].event
    assert isinstance(registered, PodRegistered)
    assert registered.requests == Share(core=10, memory=50)  # v1 fractions, upcast
    decision = per_entry[6]
    assert [type(envelope.event) for envelope in decision] == [Assigned, Assigned]


def test_the_golden_log_folds_to_both_pods_running() -> None:
    envelopes: list[Envelope] = [e for line in lines() for e in decode_entry(line)]
    state = fold(envelopes)
    assert state.pods[DEMO].phase == "running"
    assert state.pods[OLD].phase == "running"
    assert (state.pods[DEMO].gpu_index, state.pods[OLD].gpu_index) == (0, 1)


def test_a_decision_entry_reads_as_one_stored_event_per_envelope_with_one_sequence() -> None:
    entries = read_entries(7, "gpupool.log.cn-wulanchabu-c_cr-xxx.Decision", lines()[6])
    assert [(e.seq, e.index, e.last) for e in entries if isinstance(e, StoredEvent)] == [
        (7, 0, False),
        (7, 1, True),
    ]


def test_what_the_code_writes_today_reads_back_the_same() -> None:
    decision = decode_entry(lines()[6])
    assert decode_entry(encode_entry(list(decision))) == decision
    assert b'"schema":%d' % ENTRY_SCHEMA_VERSION in encode_entry(list(decision))
    single = decode_entry(lines()[0])
    assert decode_entry(encode_entry(list(single))) == single


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b'{"schema": 3, "envelopes": []}', id="empty-decision"),
        pytest.param(b'{"schema": 3}', id="no-envelopes"),
        pytest.param(b'{"schema": 3, "envelopes": [{"schema": 1}]}', id="old-envelope-inside"),
    ],
)
def test_a_broken_decision_entry_fails_with_event_decode_error(data: bytes) -> None:
    with pytest.raises(EventDecodeError):
        decode_entry(data)


def test_a_decision_entry_for_two_nodes_is_refused_both_ways() -> None:
    one, two = decode_entry(lines()[0])[0], decode_entry(lines()[1])[0]
    other = Envelope(
        id="x", time=two.time, event=Assigned(pod=DEMO, node="elsewhere", gpu_index=0, gpu_uuid="")
    )
    with pytest.raises(ValueError, match="one node"):
        encode_entry([one, other])


async def test_the_golden_log_rebuilds_through_the_event_log() -> None:
    log = InMemoryEventLog()
    for line in lines():
        await log.append_raw("gpupool.log.cn-wulanchabu-c_cr-xxx.Golden", line)
    stored = [entry async for entry in log.replay()]
    assert all(isinstance(entry, StoredEvent) for entry in stored)
    assert len(stored) == 8
    assert [entry.seq for entry in stored][-2:] == [7, 7]
