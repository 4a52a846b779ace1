"""A replay reads a pull's batch in one go (``port.read_batch``, ``decode_plain_many``, the
reply subjects' numbers in one split): every answer is the one the entry-by-entry path gives.

``read_batch`` must return the concatenation of ``read_entries`` of each entry (the same
StoredEvents, the same Undecodables with the same error text, a decision entry's envelopes
with their index and last); ``decode_plain_many`` what ``decode_plain`` returns for each
entry; ``_delivered`` the stream sequences and the gap that reading each reply subject in
turn finds. Held on seeded batches mixing plain envelopes with the golden log's entries
(schema 1, 2 and 3), poison, mutated bytes, entries of another node than their subject,
and the shapes that could shift one line of the joined decode onto another (a line break
inside an entry, two envelopes in one entry next to an empty one, an entry ending inside a
string next to one that starts in it).
"""

from __future__ import annotations

import json
import random
from itertools import chain
from pathlib import Path

import pytest
from test_log_poison import NESTED_1000, SHARE_INF_V1

from gpupool.eventlog import subject_for
from gpupool.eventlog.port import Entry, read_batch, read_entries
from gpupool.eventlog.pulled_replay import _delivered
from gpupool.events import Assigned, Envelope, PodRef, decode_entry, decode_plain, decode_plain_many
from gpupool.events.codec import (
    MAX_ENTRY_BYTES,
    MAX_JSON_DEPTH,
    EventDecodeError,
    encode_entry,
    encode_envelope,
)

GOLDEN_LOG = Path(__file__).resolve().parents[1] / "golden" / "log" / "v1-v2-v3.jsonl"
GOLDEN_LINES = [line for line in GOLDEN_LOG.read_bytes().splitlines() if line.strip()]
SEEDS = range(16)


def plain(index: int, node: str = "n1") -> bytes:
    """A current envelope of ``node``, as most of a log's entries are."""
    from datetime import UTC, datetime

    return encode_envelope(
        Envelope(
            id=f"e-{node}-{index}",
            time=datetime(2025, 4, 22, 8, 0, index % 60, tzinfo=UTC),
            event=Assigned(
                pod=PodRef(namespace="default", name=f"p{index}"),
                node=node,
                gpu_index=index % 8,
                gpu_uuid=f"GPU-{index % 8}",
            ),
        )
    )


def decision(index: int, node: str = "n1") -> bytes:
    envelopes = [decode_plain(plain(index * 10 + k, node)) for k in range(3)]
    return encode_entry([e for e in envelopes if e is not None])


def odd_entries(rng: random.Random, index: int) -> list[bytes]:
    """Entries the joined decode must not take for plain ones, or must not misalign."""
    one, two = plain(index), plain(index + 1)
    deep = one.replace(
        b"{", b'{"pad":' + b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1) + b",", 1
    )
    cut = rng.randrange(len(one))
    return rng.choice(
        [
            [one + b" " + two, b" "],  # two values on one line, an empty line beside
            [one + b"\n" + two],  # a line break inside an entry
            [one[:-2] + b'\n"}', two],
            [one[:cut], one[cut:]],  # an entry cut in two: one ends where the next goes on
            [b"  " + one, one + b"\r"],  # whitespace around an envelope (plain all the same)
            [b""],
            [deep],
            [NESTED_1000],
            [SHARE_INF_V1],
            [decision(index)],
            [decision(index, node="n2")],
            [rng.choice(GOLDEN_LINES)],
            [one[:cut] + bytes([rng.randrange(256)]) + one[cut + 1 :]],
            [one.replace(b'"schema":2', b'"schema":1')],
            [one.replace(b'"schema":2', b'"schema":9')],
            [plain(index, node="n2")],  # on n1's subject below: another node's event
            [b"{}", b"{", b"}"],  # too short for the shape's first, third and last bytes
            [event_first(one)],  # an envelope whose third byte is a decision entry's
            [b'{"envelopes_not":1}'],  # the same third byte, garbage
            # an envelope cut after a brace, finished by an entry not starting with one,
            # and two values on one line after: as many values as entries, misaligned
            [one[:-1] + b',"pad":{}', b',"x":1}', one + b" " + two],
            [line_broken_deep(one)],  # over the bracket bound only taken whole
        ]
    )


def line_broken_deep(entry: bytes) -> bytes:
    """An envelope with more brackets than the bound, no line of it over the bound: a line
    break between two nested unknown fields (refused as one entry, so in a batch too)."""
    nested = b"[" * (MAX_JSON_DEPTH - 4) + b"]" * (MAX_JSON_DEPTH - 4)
    return b'{"pad":' + nested + b',\n"pad2":' + nested + b"," + entry[1:]


def event_first(entry: bytes) -> bytes:
    """The same envelope with its ``event`` written first (plain all the same)."""
    fields = json.loads(entry)
    reordered = {"event": fields.pop("event"), **fields}
    return json.dumps(reordered, separators=(",", ":")).encode()


def batch(rng: random.Random, size: int, odd: float) -> list[bytes]:
    datas: list[bytes] = []
    while len(datas) < size:
        if rng.random() < odd:
            datas += odd_entries(rng, len(datas))
        else:
            datas.append(plain(len(datas)))
    return datas


SUBJECTS = [
    subject_for(Assigned(pod=PodRef(namespace="d", name="p"), node="n1", gpu_index=0, gpu_uuid="")),
    "gpupool.log.n1.admission-queue",
    "gpupool.log.n2.admission-queue",
    "gpupool.log._.x",
    subject_for(decode_plain(GOLDEN_LINES[-2]).event),  # type: ignore[union-attr]
    "",
]


def one_by_one(seqs: list[int], subjects: list[str], datas: list[bytes]) -> list[Entry]:
    return list(
        chain.from_iterable(map(read_entries, seqs, subjects, datas))  # each as read_entries
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_a_batch_decodes_as_each_entry_decodes_alone(seed: int) -> None:
    rng = random.Random(seed)
    for size, odd in ((rng.randrange(1, 40), 0.3), (rng.randrange(16, 1100), 0.01), (300, 0.0)):
        datas = batch(rng, size, odd)
        assert decode_plain_many(datas) == [decode_plain(data) for data in datas]


@pytest.mark.parametrize("seed", SEEDS)
def test_a_batch_reads_as_read_entries_reads_each_entry(seed: int) -> None:
    rng = random.Random(seed)
    for size, odd, subject_mix in (
        (rng.randrange(1, 60), 0.2, True),
        (600, 0.005, False),
        (200, 0.0, False),
    ):
        datas = batch(rng, size, odd)
        subjects = [rng.choice(SUBJECTS) if subject_mix else SUBJECTS[1] for _ in datas]
        seqs = list(range(rng.randrange(1, 10**6), 10**7))[: len(datas)]
        entries = read_batch(seqs, subjects, datas)
        assert entries == one_by_one(seqs, subjects, datas)


def test_a_batch_of_plain_envelopes_is_one_decode_and_refuses_another_nodes_entry() -> None:
    datas = [plain(i) for i in range(100)]
    subjects = ["gpupool.log.n1.admission-queue"] * 100
    entries = read_batch(list(range(1, 101)), subjects, datas)
    assert [entry.seq for entry in entries] == list(range(1, 101))
    datas[57] = plain(57, node="n2")
    refused = read_batch(list(range(1, 101)), subjects, datas)
    assert refused[:57] == entries[:57] and refused[58:] == entries[58:]
    assert "names node 'n1'" in refused[57].error  # type: ignore[union-attr]


def spanning_batches() -> list[list[bytes]]:
    """Batches whose entries, joined as lines, would read as other values than each alone:
    an unfinished entry that the next one (starting with ``{``) finishes, with an entry of
    two envelopes further on to make up the count; and entries each within the depth limit
    that nest far past it when read on into each other (review findings)."""
    one = plain(0)
    rest = [plain(i) for i in range(1, 6)] + [plain(90) + plain(91)]
    rest += [plain(i) for i in range(6, 16)]
    return [
        [b'{"zz":', b'{"q":1},' + one[1:], *rest],
        [b'{"zz":[1', b'{"q":1}],' + one[1:], *rest],
        [b'{"a":' * 32] * 40,
        [b'{"a":' * 32] * 1024,
        [b'{"a":' * 31 + b"{}"] * 40,  # ends with } yet still open
    ]


@pytest.mark.parametrize("index", range(5))
def test_entries_that_would_read_on_into_each_other_read_as_each_alone(index: int) -> None:
    datas = spanning_batches()[index]
    assert decode_plain_many(datas) == [decode_plain(data) for data in datas]
    subjects = ["gpupool.log.n1.admission-queue"] * len(datas)
    seqs = list(range(1, len(datas) + 1))
    assert read_batch(seqs, subjects, datas) == one_by_one(seqs, subjects, datas)


def test_an_envelope_over_the_size_limit_in_a_batch_is_refused_as_alone() -> None:
    one = plain(0)
    datas = [plain(i) for i in range(40)]
    datas[9] = b"{" + b" " * MAX_ENTRY_BYTES + one[1:]  # valid JSON, an envelope, too large
    subjects = ["gpupool.log.n1.admission-queue"] * 40
    entries = read_batch(list(range(1, 41)), subjects, datas)
    assert entries == one_by_one(list(range(1, 41)), subjects, datas)
    assert "larger than" in entries[9].error  # type: ignore[union-attr]


def test_a_decision_entry_shaped_as_an_envelope_too_is_left_to_decode_entry() -> None:
    one = plain(0)
    both = decision(3)[:-1] + b"," + one[1:]  # {"envelopes":[…],"id":…,"event":…}
    datas = [plain(i) for i in range(40)]
    datas[5] = both
    assert decode_plain_many(datas) == [decode_plain(data) for data in datas]
    assert decode_plain_many(datas)[5] is None


def test_a_decision_entry_in_a_batch_keeps_its_envelopes_index_and_last() -> None:
    datas = [plain(i) for i in range(40)]
    datas[20] = decision(7)
    entries = read_batch(list(range(1, 41)), ["gpupool.log.n1.admission-queue"] * 40, datas)
    assert len(entries) == 42
    assert [(e.seq, e.index, e.last) for e in entries[20:23]] == [  # type: ignore[union-attr]
        (21, 0, False),
        (21, 1, False),
        (21, 2, True),
    ]


@pytest.mark.parametrize("seed", SEEDS)
def test_garbage_skipping_the_one_step_decode_reads_as_it_did(seed: int) -> None:
    """``decode_entry(data, plain_tried=True)`` (the caller's ``decode_plain`` answered None,
    or its answer was refused) returns or raises exactly what ``decode_entry`` does."""
    rng = random.Random(seed)
    for data in chain.from_iterable(odd_entries(rng, index) for index in range(20)):
        try:
            expected: tuple[Envelope, ...] | str = decode_entry(data)
        except EventDecodeError as error:
            expected = f"{type(error).__name__}: {error}"
        try:
            got: tuple[Envelope, ...] | str = decode_entry(data, plain_tried=True)
        except EventDecodeError as error:
            got = f"{type(error).__name__}: {error}"
        assert got == expected


def reply(seq: int, number: int, *, domain: bool = False) -> bytes:
    where = b"hub.ACC." if domain else b""
    return b"$JS.ACK.%sGPUPOOL.gpupool-replay-1.1.%d.%d.1764662400000000000.%d" % (
        where,
        seq,
        number,
        1000 - number,
    )


def reply_by_reply(replies: list[bytes], expected: int) -> tuple[list[int], str | None]:
    seqs: list[int] = []
    for subject in replies:
        tokens = subject.split(b".")
        seq, number = (
            (int(tokens[5]), int(tokens[6]))
            if len(tokens) == 9
            else (int(tokens[7]), int(tokens[8]))
        )
        if number != expected:
            return seqs, f"delivery {number} where {expected} was next"
        expected += 1
        seqs.append(seq)
    return seqs, None


@pytest.mark.parametrize("seed", SEEDS)
def test_a_batch_of_reply_subjects_reads_as_each_reply_in_turn(seed: int) -> None:
    rng = random.Random(seed)
    start = rng.randrange(1, 5000)
    seqs = sorted(rng.sample(range(1, 10**6), 300))
    numbers = list(range(start, start + 300))
    kind = rng.randrange(4)
    if kind == 1:  # a gap: a delivery lost
        del numbers[rng.randrange(300)]
    elif kind == 2:  # a delivery seen twice
        at = rng.randrange(299)
        numbers.insert(at + 1, numbers[at])
    replies = [
        reply(seq, number, domain=kind == 3 and rng.random() < 0.5)
        for seq, number in zip(seqs, numbers, strict=False)
    ]
    assert _delivered(replies, start) == reply_by_reply(replies, start)
    if kind == 0:
        assert _delivered(replies, start) == (seqs, None)
    assert _delivered(replies, start + 1)[1] == f"delivery {start} where {start + 1} was next"
