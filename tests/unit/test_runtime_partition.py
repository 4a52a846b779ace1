"""A projection read from one node's subjects: the watermark passes the rest of the log.

A partitioned reader is handed its node's entries in log order; when it is handed sequence
S, everything below S is folded already or another node's. Its own appends, folded before
their delivery, stay folded once; a redelivery is still refused by sequence.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from gpupool.events import Envelope, PodRef, PodRegistered, Share
from gpupool.runtime.projection import Projection
from gpupool.runtime.service import _other_nodes

T0 = datetime(2025, 4, 22, 8, 0, 0, tzinfo=UTC)


def registration(name: str, node: str = "n") -> Envelope:
    share = Share(core=10, memory=10)
    return Envelope(
        id=uuid.uuid4().hex,
        time=T0,
        event=PodRegistered(
            pod=PodRef(namespace="default", name=name),
            node=node,
            policy="share-pool",
            requests=share,
            limits=share,
        ),
    )


def test_a_delivery_passes_the_other_nodes_sequences_below_it() -> None:
    projection = Projection()
    projection.pass_below(3)  # 1 and 2 were another node's
    assert projection.apply(3, registration("a"))
    assert projection.last_seq == 3
    assert not projection.ahead


def test_an_own_append_folded_early_is_passed_and_not_folded_again() -> None:
    projection = Projection()
    own = registration("own")
    assert projection.apply(5, own)  # appended by this process: folded before delivery
    assert projection.ahead == {5}
    projection.pass_below(4)  # a delivery of 4: 1..3 another node's
    assert projection.apply(4, registration("b"))
    assert projection.last_seq == 5 and not projection.ahead  # 5 was folded already
    projection.pass_below(5)  # its own delivery
    assert not projection.apply(5, own)
    assert projection.last_seq == 5


def test_a_redelivery_below_the_watermark_is_not_folded_again() -> None:
    projection = Projection()
    first = registration("a")
    projection.pass_below(7)
    assert projection.apply(7, first)
    projection.pass_below(7)
    assert not projection.apply(7, first)
    projection.pass_below(2)  # an older redelivery moves nothing back
    assert projection.last_seq == 7


def test_a_snapshot_of_other_nodes_is_recognised() -> None:
    projection = Projection()
    projection.apply(1, registration("a", node="n"))
    assert _other_nodes(projection, "n") == set()
    projection.apply(2, registration("b", node="m"))
    assert _other_nodes(projection, "n") == {"m"}
