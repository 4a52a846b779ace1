"""The log decoder's one-step path for a current envelope decides exactly as the checked path.

``decode_envelope`` and ``decode_entry`` first try to decode a small, shallow entry
straight into an ``Envelope`` and keep it only if it is of the current schema; anything
else goes the checked way (probe the version, refuse or upcast, decode). These tests
hold the two to the same answer, value or error message, on the golden log (schema 1,
2 and 3 entries), the poison entries and hypothesis-drawn mutations of them; and
``decode_entry``, which tries the one-step path even on an entry that mentions
``"envelopes"`` (unless it starts as a decision entry written by gpupool), to the answer
of the probe-first definition it had before.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_log_poison import NESTED_1000, SHARE_INF_V1, assigned_json

from gpupool.events import (
    SCHEMA_VERSION,
    Envelope,
    EventDecodeError,
    LogEntry,
    UnknownSchemaVersion,
    decode_entry,
    decode_envelope,
)
from gpupool.events.codec import (
    ENTRY_SCHEMA_VERSION,
    _decode_bounded,
    _decode_checked,
    _entry_decoder,
    _probe_version,
)

GOLDEN_LOG = Path(__file__).resolve().parents[1] / "golden" / "log" / "v1-v2-v3.jsonl"
GOLDEN_LINES = [line for line in GOLDEN_LOG.read_bytes().splitlines() if line.strip()]


def checked(data: bytes) -> Envelope | str:
    """The checked path's answer: the envelope, or the error it raises."""
    try:
        return _decode_checked(data)
    except EventDecodeError as exc:
        return f"{type(exc).__name__}: {exc}"


def decoded(data: bytes) -> Envelope | str:
    try:
        return decode_envelope(data)
    except EventDecodeError as exc:
        return f"{type(exc).__name__}: {exc}"


def is_decision_entry(data: bytes) -> bool:
    try:
        return _probe_version(data) == ENTRY_SCHEMA_VERSION
    except EventDecodeError:
        return False


def test_the_golden_log_holds_every_entry_version() -> None:
    versions = {json.loads(line)["schema"] for line in GOLDEN_LINES}
    assert versions == {1, 2, 3}


@pytest.mark.parametrize("line", GOLDEN_LINES, ids=range(len(GOLDEN_LINES)))
def test_a_golden_entry_decodes_as_the_checked_path_decodes_it(line: bytes) -> None:
    assert decoded(line) == checked(line)
    if not is_decision_entry(line):
        assert decode_entry(line) == (decode_envelope(line),)


def test_a_schema_1_entry_that_reads_as_the_current_shape_is_still_upcast() -> None:
    """Integer shares of a version-1 PodRegistered decode as the current shape, but mean
    fractions of a GPU: the fast path must hand it to the upcaster (1 GPU = 100 percent)."""
    v1 = json.dumps(
        {
            "schema": 1,
            "id": "v1-whole-gpu",
            "time": "2025-04-22T08:00:00Z",
            "event": {
                "type": "PodRegistered",
                "pod": {"namespace": "default", "name": "a"},
                "node": "n1",
                "policy": "share-pool",
                "requests": {"core": 1, "memory": 1},
                "limits": {"core": 1, "memory": 1},
            },
        }
    ).encode()

    envelope = decode_envelope(v1)

    assert envelope.schema == 2
    assert envelope.event.requests.core == 100  # type: ignore[union-attr]
    assert decode_entry(v1) == (envelope,)


SEEDS = [*GOLDEN_LINES, NESTED_1000, SHARE_INF_V1, assigned_json(3), assigned_json(5000)]


@settings(
    max_examples=300,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    seed=st.sampled_from(SEEDS),
    cut=st.integers(min_value=0, max_value=400),
    insert=st.binary(max_size=8),
)
@example(seed=GOLDEN_LINES[0], cut=0, insert=b"")
def test_a_mutated_entry_decodes_as_the_checked_path_decodes_it(
    seed: bytes, cut: int, insert: bytes
) -> None:
    data = seed[:cut] + insert + seed[cut + len(insert) :]
    assert decoded(data) == checked(data)


def entry_by_probe(data: bytes) -> tuple[Envelope, ...] | str:
    """``decode_entry`` as it was defined before it tried the one-step path on entries that
    mention ``"envelopes"``: probe the version first for those (the reference)."""
    try:
        if b'"envelopes"' not in data:
            return decode_entry(data)
        if _probe_version(data) != ENTRY_SCHEMA_VERSION:
            return (_decode_checked(data),)
        decision: LogEntry = _decode_bounded(_entry_decoder, data, "invalid decision entry")
        if not decision.envelopes:
            raise EventDecodeError("invalid decision entry: it holds no envelope")
        for envelope in decision.envelopes:
            if envelope.schema != SCHEMA_VERSION:
                raise UnknownSchemaVersion(
                    f"decision entry holds an envelope of schema {envelope.schema}; "
                    f"it must be {SCHEMA_VERSION}"
                )
        if len({envelope.event.node for envelope in decision.envelopes}) > 1:
            raise EventDecodeError("invalid decision entry: its envelopes are for several nodes")
        return decision.envelopes
    except EventDecodeError as exc:
        return f"{type(exc).__name__}: {exc}"


def entry(data: bytes) -> tuple[Envelope, ...] | str:
    try:
        return decode_entry(data)
    except EventDecodeError as exc:
        return f"{type(exc).__name__}: {exc}"


ENVELOPES_MENTIONED = [
    # an envelope that also carries an ``envelopes`` field (ignored, as every unknown field)
    GOLDEN_LINES[-1].replace(b'{"', b'{"envelopes":[],"', 1),
    *(line.replace(b'{"', b'{"envelopes":1,"', 1) for line in GOLDEN_LINES),
    *(line for line in GOLDEN_LINES if b'"envelopes"' in line),
]


@pytest.mark.parametrize("line", ENVELOPES_MENTIONED, ids=range(len(ENVELOPES_MENTIONED)))
def test_an_entry_mentioning_envelopes_decodes_as_the_probe_decodes_it(line: bytes) -> None:
    assert entry(line) == entry_by_probe(line)


@settings(
    max_examples=300,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    seed=st.sampled_from(ENVELOPES_MENTIONED),
    cut=st.integers(min_value=0, max_value=400),
    insert=st.binary(max_size=12) | st.sampled_from([b'"envelopes":', b'{"envelopes":[']),
)
def test_a_mutated_entry_mentioning_envelopes_decodes_as_the_probe_decodes_it(
    seed: bytes, cut: int, insert: bytes
) -> None:
    data = seed[:cut] + insert + seed[cut + len(insert) :]
    assert entry(data) == entry_by_probe(data)
