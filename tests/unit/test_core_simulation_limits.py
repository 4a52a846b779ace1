"""A scenario that never settles is an error naming the limit, not a hang."""

from __future__ import annotations

import pytest

from gpupool.core.simulation import (
    Scenario,
    ScenarioAction,
    ScenarioError,
    ScenarioNode,
    ScenarioPod,
    ScenarioShare,
    simulate,
)

WHOLE = ScenarioShare(core=100, memory=100)
ROTATION = Scenario(
    max_events=500,
    nodes=[
        ScenarioNode(name="n1", gpus=1, qos='{"preemptEnabled": true, "podMaxDurationMinutes": 1}')
    ],
    pods=[
        ScenarioPod(
            name=name,
            node="n1",
            requests=ScenarioShare(core=10, memory=10),
            limits=WHOLE,
            requeue=True,
        )
        for name in ("a", "b")
    ],
    # each task needs 2 minutes, but the fairness limit preempts it after 1 and it restarts
    timeline=[ScenarioAction(at=0, action="ready", pod=name, runs_for=120) for name in ("a", "b")],
)


def test_an_endless_rotation_stops_at_max_events() -> None:
    with pytest.raises(ScenarioError, match="has not settled after 500 events"):
        simulate(ROTATION)


def test_the_same_tasks_finish_when_they_fit_in_the_limit() -> None:
    short = ROTATION.__class__(
        **{
            **{f: getattr(ROTATION, f) for f in ROTATION.__struct_fields__},
            "timeline": [
                ScenarioAction(at=0, action="ready", pod=n, runs_for=50) for n in ("a", "b")
            ],
        }
    )
    log = simulate(short)
    assert [type(e.event).__name__ for e in log].count("Released") == 2
