"""The codec's depth check before decoding: the bytes-method count agrees with the character
scan on every input where it answers, and deep entries are still refused."""

from __future__ import annotations

import random
from datetime import UTC, datetime

import pytest

from gpupool.events import Assigned, Envelope, PodRef, decode_entry, encode_entry
from gpupool.events.codec import (
    MAX_JSON_DEPTH,
    EntryTooDeep,
    _json_depth,
    _json_depth_plain,
    _json_depth_scanned,
)

ALPHABET = b'[]{}"a\\:,'


def test_the_plain_count_agrees_with_the_character_scan_on_random_bytes() -> None:
    rng = random.Random(10)
    answered = 0
    for _ in range(20_000):
        data = bytes(rng.choice(ALPHABET) for _ in range(rng.randint(0, 40)))
        plain = _json_depth_plain(data)
        if plain is not None:
            answered += 1
            assert plain == _json_depth_scanned(data), data
        assert _json_depth(data) == _json_depth_scanned(data), data
    assert answered > 500  # the plain count answers for many of them, not only the empty


@pytest.mark.parametrize(
    ("data", "depth"),
    [
        (b"", 0),
        (b"{}", 1),
        (b'[{"a": [1, {"b": []}]}]', 5),
        (b'{"name": "[[[[{{{{"}', 1),  # brackets inside a string do not count
        (b'{"a": "}"}', 1),
        (b"[" * 40 + b"]" * 40, 40),  # deeper than the plain count goes: scanned
        (b'{"a": "\\"[["}', 1),  # an escaped quote: scanned
        (b"[[[", 3),  # unbalanced: scanned
    ],
)
def test_the_depth_of_examples(data: bytes, depth: int) -> None:
    assert _json_depth(data) == depth


def decision(pods: int) -> list[Envelope]:
    now = datetime.now(UTC)
    return [
        Envelope(
            id=f"e{index}",
            time=now,
            event=Assigned(
                pod=PodRef(namespace="ns", name=f"p{index}"),
                node="n1",
                gpu_index=index % 8,
                gpu_uuid=f"GPU-{index % 8}",
            ),
            correlation_id="c",
            causation_id="d",
        )
        for index in range(pods)
    ]


def test_a_large_decision_entry_is_counted_without_the_scan_and_decodes() -> None:
    envelopes = decision(300)
    data = encode_entry(envelopes)
    assert data.count(b"{") > MAX_JSON_DEPTH  # the count alone does not clear it
    assert _json_depth_plain(data) == _json_depth_scanned(data)
    assert decode_entry(data) == tuple(envelopes)


def test_a_decision_entry_nested_past_the_limit_is_refused() -> None:
    deep = b'{"envelopes": [], "schema": 3, "x": ' + b"[" * 200 + b"]" * 200 + b"}"
    with pytest.raises(EntryTooDeep, match="nested deeper"):
        decode_entry(deep)
