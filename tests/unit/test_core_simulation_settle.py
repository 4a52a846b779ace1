"""The simulator settles a node in as few decisions as the services' loop needs, with the same log.

After a Schedule and a PlanPreemption on a node, ``Simulator._settle`` stops unless a
preemption was planned: a Schedule on the state its own Assigned made decides nothing,
and the PlanPreemption already saw that state. The reference below settles the way it
did before, deciding again until a round decides nothing at all; on seeded random
scenarios (priorities, backfill, preemption by priority and by max duration, requeue,
cancel/fail/oom/delete, static nodes) both give the same log, event for event.
"""

from __future__ import annotations

import random
from datetime import datetime, timedelta

import pytest

from gpupool.core.decide import PlanPreemption, ReportRelease, RequestGpu, Schedule
from gpupool.core.preemption import next_preemption_check
from gpupool.core.simulation import (
    ActionKind,
    Scenario,
    ScenarioAction,
    ScenarioNode,
    ScenarioPod,
    ScenarioShare,
    Simulator,
    _Completion,
    _PreemptionCheck,
)
from gpupool.events import Assigned, Preempted, Released

QOS = (
    None,
    '{"preemptEnabled": true, "podMaxDurationMinutes": 5}',
    '{"preemptEnabled": true}',
    '{"backfill": true}',
    '{"backfill": true, "preemptEnabled": true, "podMaxDurationMinutes": 3}',
)
ACTIONS: tuple[ActionKind, ...] = ("ready", "ready", "ready", "cancel", "fail", "oom", "delete")


class SettleUntilNothing(Simulator):
    """The settle loop as it was: decide again until a round decides nothing."""

    def _settle(self, node: str, now: datetime) -> None:
        while True:
            assigned = self._run(Schedule(node=node), now)
            for event in assigned:
                if isinstance(event, Assigned) and event.pod in self._runs_for:
                    self._completion_due[event.pod] = len(self.log)
                    self._timer(
                        now + timedelta(seconds=self._runs_for[event.pod]),
                        _Completion(pod=event.pod, node=node, token=len(self.log)),
                    )
            preempted = self._run(PlanPreemption(node=node), now)
            for event in preempted:
                if isinstance(event, Preempted):
                    self._completion_due.pop(event.victim, None)
                    released = self._run(
                        ReportRelease(pod=event.victim, node=node, reason="preempted"), now
                    )
                    if event.victim in self._requeue and any(
                        isinstance(r, Released) for r in released
                    ):
                        self._run(RequestGpu(pod=event.victim, node=node), now)
            if not assigned and not preempted:
                break
        check = next_preemption_check(self.state, node, now)
        if check is not None and (node, check) not in self._checks_due:
            self._checks_due.add((node, check))
            self._timer(check, _PreemptionCheck(node=node))


def random_scenario(seed: int) -> Scenario:
    rng = random.Random(seed)
    nodes = [
        ScenarioNode(
            name=f"n{n}",
            gpus=rng.choice([1, 2, 4]),
            policy="static" if rng.random() < 0.15 else "share-pool",
            qos=rng.choice(QOS),
        )
        for n in range(rng.randint(1, 3))
    ]
    pods: list[ScenarioPod] = []
    timeline: list[ScenarioAction] = []
    for p in range(rng.randint(3, 14)):
        node = rng.choice(nodes)
        limit = rng.choice([10, 25, 40, 50, 60, 100])
        request = rng.randint(1, limit)
        pod = ScenarioPod(
            name=f"pod-{p}",
            node=node.name,
            policy=node.policy,
            requests=ScenarioShare(core=request, memory=request),
            limits=ScenarioShare(core=limit, memory=rng.choice([limit, request])),
            priority=rng.choice([0, 0, 1, 5, -1]),
            requeue=rng.random() < 0.3,
        )
        pods.append(pod)
        at = 0.0
        for _ in range(rng.randint(1, 6)):
            at += rng.expovariate(1 / 120)
            action = rng.choice(ACTIONS)
            timeline.append(
                ScenarioAction(
                    at=round(at, 3),
                    action=action,
                    pod=pod.name,
                    runs_for=round(rng.expovariate(1 / 200), 3) if action == "ready" else None,
                )
            )
    return Scenario(nodes=nodes, pods=pods, timeline=timeline, max_events=20_000)


@pytest.mark.parametrize("seed", range(60))
def test_settling_stops_after_a_round_without_preemption_and_logs_the_same(seed: int) -> None:
    scenario = random_scenario(seed)

    assert Simulator(scenario).run() == SettleUntilNothing(scenario).run()


def test_the_random_scenarios_assign_preempt_and_backfill() -> None:
    """The scenarios above exercise what the shortcut could get wrong."""
    kinds: set[str] = set()
    for seed in range(60):
        for envelope in Simulator(random_scenario(seed)).run():
            kinds.add(type(envelope.event).__name__)
    assert {"Assigned", "Preempted", "Released", "PodReady"} <= kinds
