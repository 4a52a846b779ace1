"""The simulator plays the executor as the real one does (issue 9, finding 7 and Releasing)."""

from __future__ import annotations

import json

from gpupool.core.simulation import (
    Scenario,
    ScenarioAction,
    ScenarioNode,
    ScenarioPod,
    ScenarioShare,
    simulate,
)
from gpupool.events import Assigned, NodeConfigured, NodeRejected, PodRejected, PodRemoved, Released

FULL = ScenarioShare(core=100, memory=100)
SMALL = ScenarioShare(core=1, memory=1)
PREEMPTING = json.dumps({"preemptEnabled": True})


def pod(name: str, priority: int = 0) -> ScenarioPod:
    return ScenarioPod(name=name, node="n", requests=SMALL, limits=FULL, priority=priority)


def test_a_preempted_simulated_pod_loses_its_completion_timer() -> None:
    """Its old timer fired later and released a pod that no longer ran: a spurious PodRejected."""
    log = simulate(
        Scenario(
            nodes=[ScenarioNode(name="n", gpus=1, qos=PREEMPTING)],
            pods=[pod("low"), pod("high", priority=5)],
            timeline=[
                ScenarioAction(at=0, action="ready", pod="low", runs_for=60),
                ScenarioAction(at=10, action="ready", pod="high"),
            ],
        )
    )
    events = [envelope.event for envelope in log]
    assert any(isinstance(e, Released) and e.reason == "preempted" for e in events)
    assert not any(isinstance(e, PodRejected) for e in events), events


def test_set_policy_keeps_the_nodes_whole_gpu_pods_in_view() -> None:
    log = simulate(
        Scenario(
            nodes=[
                ScenarioNode(name="n", gpus=1, policy="none", exclusive_gpu_pods=["default/train"])
            ],
            timeline=[ScenarioAction(at=1, action="set-policy", node="n", policy="share-pool")],
        )
    )
    events = [envelope.event for envelope in log]
    assert not any(isinstance(e, NodeConfigured) for e in events)
    assert any(
        isinstance(e, NodeRejected) and e.reason == "ExclusiveGpuPodsPresent" for e in events
    )


def test_deleting_a_running_simulated_pod_releases_it_before_the_next_gets_its_gpu() -> None:
    log = simulate(
        Scenario(
            nodes=[ScenarioNode(name="n", gpus=1)],
            pods=[pod("a"), pod("b")],
            timeline=[
                ScenarioAction(at=0, action="ready", pod="a"),
                ScenarioAction(at=1, action="ready", pod="b"),
                ScenarioAction(at=2, action="delete", pod="a"),
            ],
        )
    )
    kinds = [
        (type(e.event).__name__, getattr(e.event, "pod", None) and e.event.pod.name)  # type: ignore[union-attr]
        for e in log
        if isinstance(e.event, PodRemoved | Released | Assigned)
    ]
    assert kinds[-3:] == [("PodRemoved", "a"), ("Released", "a"), ("Assigned", "b")]
