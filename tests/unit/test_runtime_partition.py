"""A projection read from one node's subjects: the watermark passes the rest of the log.

When a partitioned reader knows everything below sequence S is folded already or another
node's (an ordered replay handed it S, or a delivery proves it follows a passed sequence:
tests/integration/test_partition_redelivery.py), the watermark passes below S. Its own
appends, folded before their delivery, stay folded once; a redelivery is still refused by
sequence.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import yaml

from gpupool.core import evolve
from gpupool.core.simulation import Scenario, simulate
from gpupool.events import Envelope, PodRef, PodRegistered, Share, event_node
from gpupool.runtime.partition import restrict_to_node
from gpupool.runtime.projection import Projection, metrics_projection
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


ROOT = Path(__file__).resolve().parents[2]


def scenario_log(name: str, *, node: str | None = None) -> list[Envelope]:
    """A scenario's events, its one node renamed to ``node``."""
    scenario = msgspec.convert(
        yaml.safe_load((ROOT / "scenarios" / f"{name}.yaml").read_text()), Scenario
    )
    if node is not None:
        scenario = msgspec.structs.replace(
            scenario,
            nodes=[msgspec.structs.replace(n, name=node) for n in scenario.nodes],
            pods=[msgspec.structs.replace(p, node=node) for p in scenario.pods],
            timeline=[
                msgspec.structs.replace(a, node=node) if a.node is not None else a
                for a in scenario.timeline
            ],
        )
    # the simulator numbers its envelopes from 1: give each scenario its own ids
    return [msgspec.structs.replace(e, id=f"{name}-{e.id}") for e in simulate(scenario)]


def interleaved() -> list[Envelope]:
    """Three nodes' traffic (assignments, preemptions, releases, max-duration evictions), in
    the order of their times: one log as a cluster writes it."""
    logs = [
        scenario_log("worked-example"),
        scenario_log("preemption-priority"),
        scenario_log("fairness-max-duration", node="gpu-node-2"),
    ]
    return sorted((e for log in logs for e in log), key=lambda e: e.time)  # stable


def partitioned_fold(envelopes: list[Envelope], node: str) -> Projection:
    """What a reader of ``node``'s subjects folds: its entries only, the rest passed."""
    projection = metrics_projection()
    for seq, envelope in enumerate(envelopes, start=1):
        if event_node(envelope.event) == node:
            projection.pass_below(seq)
            projection.apply(seq, envelope)
    projection.pass_below(len(envelopes) + 1)  # as its next delivery, after the rest, does
    return projection


def test_a_whole_log_fold_restricted_to_a_node_is_what_its_partition_folds() -> None:
    envelopes = interleaved()
    nodes = {event_node(e.event) for e in envelopes}
    assert len(nodes) == 3
    whole = metrics_projection()
    for seq, envelope in enumerate(envelopes, start=1):
        whole.apply(seq, envelope)
    assert not whole.take_refused()  # every envelope applied: nothing trivially equal
    for node in sorted(nodes):
        restricted = restrict_to_node(whole, node)
        own = partitioned_fold(envelopes, node)
        assert _other_nodes(restricted, node) == set()
        assert restricted.state.pods  # not trivially empty
        mine, theirs = restricted.to_snapshot(), own.to_snapshot()
        # the only difference: the whole fold remembers every node's envelope ids (so a
        # replay of another node's envelope on this node's subjects is still recognised)
        assert set(theirs.applied_ids) <= set(mine.applied_ids)
        assert msgspec.structs.replace(mine, applied_ids=[]) == msgspec.structs.replace(
            theirs, applied_ids=[]
        )


def test_restricting_leaves_the_whole_projection_as_it_was() -> None:
    envelopes = interleaved()
    whole = metrics_projection()
    for seq, envelope in enumerate(envelopes, start=1):
        whole.apply(seq, envelope)
    before = whole.to_snapshot()
    restricted = restrict_to_node(whole, "gpu-node-1")
    evolve(restricted.state, envelopes[-1])  # a change to the part is not one of the whole
    restricted.node_seq["gpu-node-1"] = 10**6
    assert whole.to_snapshot() == before
