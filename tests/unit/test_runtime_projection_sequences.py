"""A node's and a writer's sequence (the expectations of a node-wide and of a writer-scoped
decision) never move back when an entry is folded in order.

A decision entry above the watermark, folded in part (its other envelopes not yet read),
counts as applied: a decision of this process that landed on it (``landed_node_wide``) or
a conflict naming it (``learn_writer_seq``) moves the node's or the writer's sequence to
it, ahead of the watermark, while nothing is folded ahead. The entries up to it, folded
in order after that, must leave that sequence where it is, by either fold (the first of
them ends the part-folded entry's hold, so the next one takes the one-entry fold's fast
path: it must compare, not set)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

import pytest

from gpupool.events import Envelope, PodRef, PodRejected
from gpupool.runtime.projection import Projection

WRITER = "gpupool"


def rejected(number: int) -> Envelope:
    return Envelope(
        id=f"entry-{number}",
        time=datetime(2026, 1, 1, tzinfo=UTC),
        event=PodRejected(
            pod=PodRef(namespace="ns", name=f"pod-{number}"),
            node="node-a",
            reason="Invalid",
            message="a test entry",
        ),
    )


def moved_ahead(move: Callable[[Projection], None]) -> Projection:
    """Entry 1 folded, entry 4 (a decision entry) folded in part, entries 2 and 3 not yet
    seen; then ``move`` moves a sequence to 4."""
    projection = Projection()
    projection.apply_one(1, rejected(1), WRITER)
    projection.apply(4, rejected(40), index=0, last=False, writer=WRITER)
    assert projection.last_seq == 1 and not projection.ahead
    move(projection)
    return projection


def fold_in_order(projection: Projection, fold: str) -> None:
    """Entries 2 and 3, the watermark's next each (the first one ends the part-folded
    entry's hold on the fold: the second is an in-order entry with nothing held)."""
    for seq in (2, 3):
        if fold == "apply_one":
            assert projection.apply_one(seq, rejected(seq), WRITER)
        else:
            assert projection.apply(seq, rejected(seq), writer=WRITER)
    assert projection.last_seq == 3


@pytest.mark.parametrize("fold", ["apply_one", "apply"])
def test_a_node_sequence_moved_to_an_entry_folded_in_part_stays_when_the_next_is_folded(
    fold: str,
) -> None:
    projection = moved_ahead(lambda projection: projection.landed_node_wide("node-a", 4))
    assert projection.node_seq["node-a"] == 4
    fold_in_order(projection, fold)
    assert projection.node_seq["node-a"] == 4


@pytest.mark.parametrize("fold", ["apply_one", "apply"])
def test_a_writer_sequence_learned_at_an_entry_folded_in_part_stays_when_the_next_is_folded(
    fold: str,
) -> None:
    def learn(projection: Projection) -> None:
        assert projection.learn_writer_seq("node-a", WRITER, 4)

    projection = moved_ahead(learn)
    assert projection.writer_seq[("node-a", WRITER)] == 4
    fold_in_order(projection, fold)
    assert projection.writer_seq[("node-a", WRITER)] == 4
    assert projection.node_seq["node-a"] == 3  # (the node's sequence was not moved)
