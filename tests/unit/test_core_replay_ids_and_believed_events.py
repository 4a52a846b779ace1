"""Two pieces the rebuild's fold reads for every entry, held to their definitions.

* ``EnvelopeIds``: the last ``limit`` envelope ids applied, oldest first; an id added
  again keeps its place (as in the ``OrderedDict`` it replaced), and two are equal only
  with the same ids in the same order.
* ``believed_events(writer)``: exactly the event types ``producer_problem`` finds no
  problem with from that writer.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from pathlib import Path

import pytest

from gpupool.core.admission_check import EnvelopeIds
from gpupool.core.producers import (
    LEGACY_TOKENS,
    PRODUCERS,
    UNATTRIBUTED_WRITERS,
    believed_events,
    producer_problem,
)
from gpupool.events import ALL_EVENT_TYPES, decode_envelope

GOLDEN = Path(__file__).parents[1] / "golden" / "events"


def test_envelope_ids_keep_the_last_ids_in_the_order_an_ordered_dict_keeps_them() -> None:
    rng = random.Random(10)
    ids = EnvelopeIds(limit=50)
    reference: OrderedDict[str, None] = OrderedDict()
    for _ in range(2000):
        envelope_id = f"e{rng.randrange(120)}"  # many added again
        ids.add(envelope_id)
        reference[envelope_id] = None
        if len(reference) > 50:
            reference.popitem(last=False)
        assert (envelope_id in ids) and len(ids) == len(reference)
    assert ids.to_list() == list(reference) == list(ids)
    assert all((f"e{n}" in ids) == (f"e{n}" in reference) for n in range(120))


def test_envelope_ids_from_a_list_keep_its_first_places_and_compare_by_order() -> None:
    ids = EnvelopeIds(["a", "b", "a", "c"], limit=3)
    assert ids.to_list() == ["a", "b", "c"]
    assert ids == EnvelopeIds(["a", "b", "c"])
    assert ids != EnvelopeIds(["b", "a", "c"])
    ids.add("d")
    assert ids.to_list() == ["b", "c", "d"] and "a" not in ids


WRITERS = [None, *PRODUCERS, *UNATTRIBUTED_WRITERS, *sorted(LEGACY_TOKENS), "someone-else", ""]


@pytest.mark.parametrize("writer", WRITERS)
def test_believed_events_are_the_types_producer_problem_lets_through(writer: str | None) -> None:
    events = [
        decode_envelope((GOLDEN / f"{event_type.__name__}.json").read_bytes()).event
        for event_type in ALL_EVENT_TYPES
    ]
    assert believed_events(writer) == frozenset(
        type(event) for event in events if producer_problem(event, writer) is None
    )
