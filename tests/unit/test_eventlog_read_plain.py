"""A replay reads each entry with ``read_plain`` first and ``read_entries`` where it declines:
the two together decide exactly as ``read_entries`` alone.

``read_plain`` takes only the most frequent case (one current envelope, for the node its
subject names) and returns None for anything else; where it returns an entry, it is the
one ``read_entries`` returns, alone. Held on the golden log (schema 1, 2 and 3 entries),
the poison entries and hypothesis-drawn mutations of them, on subjects naming the events'
node, another node, no node (``_``) and no subject at all (an export line).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_log_poison import NESTED_1000, SHARE_INF_V1, assigned_json

from gpupool.eventlog import subject_for
from gpupool.eventlog.port import Entry, StoredEvent, read_entries, read_plain
from gpupool.events import decode_envelope, decode_plain
from gpupool.events.codec import MAX_JSON_DEPTH

GOLDEN_LOG = Path(__file__).resolve().parents[1] / "golden" / "log" / "v1-v2-v3.jsonl"
GOLDEN_LINES = [line for line in GOLDEN_LOG.read_bytes().splitlines() if line.strip()]
SEEDS = [*GOLDEN_LINES, NESTED_1000, SHARE_INF_V1, assigned_json(3), assigned_json(5000)]
SUBJECTS = [
    subject_for(decode_envelope(GOLDEN_LINES[-2]).event),  # the golden node's (schema 2)
    "gpupool.log.n1.admission-queue",
    "gpupool.log.n2.node-executor",
    "gpupool.log._.x",
    "",  # an export line: not checked
]


def as_a_replay_reads(seq: int, subject: str, data: bytes) -> tuple[Entry, ...]:
    plain = read_plain(seq, subject, data)
    return (plain,) if plain is not None else read_entries(seq, subject, data)


@pytest.mark.parametrize(("subject", "taken"), [(s, s in (SUBJECTS[0], "")) for s in SUBJECTS])
def test_a_golden_entry_reads_as_read_entries_reads_it(subject: str, taken: bool) -> None:
    plain = 0
    for seq, line in enumerate(GOLDEN_LINES, start=1):
        assert as_a_replay_reads(seq, subject, line) == read_entries(seq, subject, line)
        plain += read_plain(seq, subject, line) is not None
    # taken for the current envelopes on the golden node's subject (or none); never elsewhere
    current = sum(json.loads(line)["schema"] == 2 for line in GOLDEN_LINES)
    assert plain == (current if taken else 0)


def test_an_entry_for_another_node_than_its_subject_is_declined_and_refused() -> None:
    data = assigned_json(3, node="n1")
    assert isinstance(read_plain(7, "gpupool.log.n1.admission-queue", data), StoredEvent)
    assert read_plain(7, "gpupool.log.n2.admission-queue", data) is None
    (refused,) = read_entries(7, "gpupool.log.n2.admission-queue", data)
    assert "names node 'n2'" in refused.error  # type: ignore[union-attr]


@settings(
    max_examples=300,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    seed=st.sampled_from(SEEDS),
    subject=st.sampled_from(SUBJECTS),
    cut=st.integers(min_value=0, max_value=400),
    insert=st.binary(max_size=8) | st.sampled_from([b"[", b"{", b"[[", b'"node":"n2",']),
)
@example(seed=GOLDEN_LINES[0], subject=SUBJECTS[0], cut=0, insert=b"")
def test_a_mutated_entry_reads_as_read_entries_reads_it(
    seed: bytes, subject: str, cut: int, insert: bytes
) -> None:
    data = seed[:cut] + insert + seed[cut + len(insert) :]
    assert as_a_replay_reads(11, subject, data) == read_entries(11, subject, data)


def test_the_one_step_decode_bounds_the_nesting_by_both_kinds_of_bracket() -> None:
    """The one-step path takes an entry only if its ``[`` and ``{`` together are at most
    MAX_JSON_DEPTH (it cannot nest deeper); beyond, the checked path decides."""
    base = assigned_json(3)
    opened = base.count(b"{")
    assert b"[" not in base

    def with_arrays(count: int) -> bytes:  # an unknown field (ignored) holding ``count`` [
        pad = b"[" + b",".join([b"[]"] * (count - 1)) + b"]"
        return base.replace(b"{", b'{"pad":' + pad + b",", 1)

    assert decode_plain(base) is not None
    for count in (1, MAX_JSON_DEPTH - opened):
        assert with_arrays(count).count(b"[") == count
        assert decode_plain(with_arrays(count)) == decode_plain(base)
    beyond = with_arrays(MAX_JSON_DEPTH - opened + 1)
    assert decode_plain(beyond) is None
    assert as_a_replay_reads(1, "", beyond) == read_entries(1, "", beyond)
