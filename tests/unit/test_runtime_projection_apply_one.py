"""``Projection.apply_one`` (the rebuild's way to fold an entry of one envelope) folds exactly
as ``Projection.apply`` does.

Logs come from the core simulator (readiness, completion, cancellation, failures, OOM,
preemption by priority and by maximum duration, requeueing) and are then disturbed by a
seeded generator: entries appended again (same id, and a new id), dropped, folded out of
order or with a gap, events named on another node, Assigned on GPUs the node lacks or
with another UUID, inventories in an unusual order or none at all, writers that may or may
not append such events. Each entry is folded by both ways into two projections; every
answer, every refusal and the whole projection (state, statistics, envelope ids, node and
writer sequences, watermark) must be the same.
"""

from __future__ import annotations

import random

import msgspec
import pytest

from gpupool.core.simulation import (
    ActionKind,
    Scenario,
    ScenarioAction,
    ScenarioNode,
    ScenarioPod,
    ScenarioShare,
    simulate,
)
from gpupool.events import (
    Assigned,
    Envelope,
    GpuInventoryReported,
    PodReady,
    PodRejected,
    Released,
)
from gpupool.runtime.projection import Projection, metrics_projection

WRITERS = [
    "gpupool",
    "gpupool",
    "gpupool",
    None,
    "admission-queue",
    "node-executor",
    "policy",
    "preemption",
    "simulator",
    "PodReady",
    "someone-else",
]


def scenario(seed: int) -> Scenario:
    rng = random.Random(seed)
    node = ScenarioNode(
        name=f"node-{seed}",
        gpus=rng.choice([1, 2, 4]),
        qos='{"preemptEnabled": true, "podMaxDurationMinutes": 10}',
    )
    pods: list[ScenarioPod] = []
    timeline: list[ScenarioAction] = []
    for p in range(8):
        limit = rng.choice([25, 50, 50, 100])
        pod = ScenarioPod(
            name=f"pod-{p}",
            node=node.name,
            requests=ScenarioShare(core=min(limit, 30), memory=min(limit, 30)),
            limits=ScenarioShare(core=limit, memory=limit),
            priority=rng.choice([0, 0, 100]),
            requeue=rng.random() < 0.2,
        )
        pods.append(pod)
        at = 0.0
        for _ in range(25):
            at += rng.expovariate(1 / 400)
            if rng.random() < 0.8:
                timeline.append(
                    ScenarioAction(
                        at=at, action="ready", pod=pod.name, runs_for=rng.expovariate(1 / 300)
                    )
                )
            else:
                kind: ActionKind = rng.choice(["cancel", "fail", "oom"])
                timeline.append(ScenarioAction(at=at, action=kind, pod=pod.name))
    return Scenario(nodes=[node], pods=pods, timeline=timeline)


def disturbed(log: list[Envelope], rng: random.Random) -> list[Envelope]:
    """The log with some entries dropped, appended again or changed (seeded)."""
    out: list[Envelope] = []
    for envelope in log:
        roll = rng.random()
        event = envelope.event
        if roll < 0.03:
            continue  # dropped: later events of the pod may be refused
        if roll < 0.06 and out:
            out.append(rng.choice(out))  # appended again: same id
        elif roll < 0.09 and out:
            earlier = rng.choice(out)
            out.append(msgspec.structs.replace(earlier, id=earlier.id + "-again"))
        if roll > 0.97 and isinstance(event, PodReady | Assigned | Released | PodRejected):
            envelope = msgspec.structs.replace(
                envelope, event=msgspec.structs.replace(event, node="elsewhere")
            )
        elif roll > 0.94 and isinstance(event, Assigned):
            changed = rng.choice(
                [
                    {"gpu_index": event.gpu_index + 8},
                    {"gpu_index": -1},
                    {"gpu_uuid": "GPU-other"},
                ]
            )
            envelope = msgspec.structs.replace(
                envelope, event=msgspec.structs.replace(event, **changed)
            )
        elif isinstance(event, GpuInventoryReported) and roll > 0.5:
            gpus = event.gpus[::-1] if roll > 0.75 else ()
            envelope = msgspec.structs.replace(
                envelope, event=msgspec.structs.replace(event, gpus=gpus)
            )
        out.append(envelope)
    return out


def fold_both_ways(log: list[Envelope], rng: random.Random, *, statistics: bool) -> None:
    make = metrics_projection if statistics else Projection
    general, fast = make(), make()
    seqs = list(range(1, len(log) + 1))
    for at in range(0, len(seqs) - 1, 37):  # now and then two entries out of order
        if rng.random() < 0.3:
            seqs[at], seqs[at + 1] = seqs[at + 1], seqs[at]
    gap = rng.randrange(len(seqs))  # one sequence never folded: the watermark waits there
    for seq, envelope in zip(seqs, log, strict=True):
        if seq == gap:
            continue
        writer = rng.choice(WRITERS)
        assert fast.apply_one(seq, envelope, writer) == general.apply(seq, envelope, writer=writer)
        assert fast.take_refused() == general.take_refused()
    assert fast == general
    assert fast.statistics == general.statistics
    assert fast.envelope_ids.to_list() == general.envelope_ids.to_list()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("statistics", [True, False], ids=["statistics", "no-statistics"])
def test_apply_one_folds_a_disturbed_log_as_apply_does(seed: int, statistics: bool) -> None:
    rng = random.Random(seed)
    log = disturbed(simulate(scenario(seed)), rng)
    fold_both_ways(log, rng, statistics=statistics)


@pytest.mark.parametrize("seed", range(3))
def test_apply_one_folds_an_undisturbed_log_as_apply_does(seed: int) -> None:
    log = simulate(scenario(100 + seed))
    general, fast = metrics_projection(), metrics_projection()
    for seq, envelope in enumerate(log, start=1):
        assert fast.apply_one(seq, envelope, "gpupool") == general.apply(
            seq, envelope, writer="gpupool"
        )
    assert fast == general
    assert general.take_refused() == []


def test_apply_one_settles_the_common_entries_itself() -> None:
    """The fast path is taken (else the tests above would compare ``apply`` with itself):
    of an undisturbed log, only the rare event types reach ``apply``."""
    log = simulate(scenario(7))
    fast = metrics_projection()
    general_calls: list[str] = []
    apply = fast.apply

    def counting(seq: int, envelope: Envelope, **kwargs: object) -> bool:
        general_calls.append(type(envelope.event).__name__)
        return apply(seq, envelope, **kwargs)  # type: ignore[arg-type]

    fast.apply = counting  # type: ignore[method-assign]
    for seq, envelope in enumerate(log, start=1):
        fast.apply_one(seq, envelope, "gpupool")
    common = {"PodReady", "Assigned", "Released", "PodRejected"}
    assert sum(type(e.event).__name__ in common for e in log) > len(log) // 2
    assert not common & set(general_calls)


def test_apply_one_hands_an_observed_projection_to_apply() -> None:
    log = simulate(scenario(8))
    seen: list[int] = []
    fast = metrics_projection()
    fast.observers.append(lambda state, envelope, seq: seen.append(seq))
    general = metrics_projection()
    for seq, envelope in enumerate(log, start=1):
        fast.apply_one(seq, envelope, "gpupool")
        general.apply(seq, envelope, writer="gpupool")
    assert seen == list(range(1, len(log) + 1))
    fast.observers.clear()
    assert fast == general
