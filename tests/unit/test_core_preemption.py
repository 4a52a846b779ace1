"""Preemption planning (docs/behaviour.md, victim selection), as tables and given/when/then."""

from __future__ import annotations

from datetime import datetime

import pytest
from core_gwt import (
    NODE,
    T0,
    Run,
    Wait,
    at,
    given_state,
    gpu_uuid,
    gwt,
    node_events,
    ref,
    registered,
    topology,
)

from gpupool.core import (
    PlanPreemption,
    ReportRelease,
    RequestGpu,
    Schedule,
    next_preemption_check,
    queue_positions,
)
from gpupool.core.preemption import eligibility
from gpupool.events import Assigned, PodReady, Preempted, PreemptReason, QosConfig, Released

ON = QosConfig(preempt_enabled=True)
FAIR = QosConfig(preempt_enabled=True, pod_max_duration_minutes=120)
OFF = QosConfig(preempt_enabled=False, pod_max_duration_minutes=120)

Expected = list[tuple[str, str, int, PreemptReason]]
"""(victim, preemptor, gpu, reason) in the order the Preempted events come."""

PREEMPTION = [
    pytest.param(
        ON,
        1,
        [Run("low", 0, 100, priority=0)],
        [Wait("high", 100, priority=5)],
        at(1),
        [("low", "high", 0, "priority")],
        id="priority",
    ),
    pytest.param(
        FAIR,
        1,
        [Run("old", 0, 100)],
        [Wait("new", 100)],
        at(minutes=120),
        [("old", "new", 0, "max-duration")],
        id="fairness-after-pod-max-duration",
    ),
    pytest.param(
        FAIR,
        1,
        [Run("old", 0, 100)],
        [Wait("new", 100)],
        at(minutes=119, seconds=59),
        [],
        id="fairness-not-before-pod-max-duration",
    ),
    pytest.param(
        ON,
        1,
        [Run("old", 0, 100)],
        [Wait("new", 100)],
        at(minutes=100_000),
        [],
        id="no-fairness-without-pod-max-duration",
    ),
    pytest.param(
        OFF,
        1,
        [Run("low", 0, 100, priority=0)],
        [Wait("high", 100, priority=5)],
        at(minutes=500),
        [],
        id="preempt-enabled-false",
    ),
    pytest.param(
        QosConfig(),
        1,
        [Run("low", 0, 100, priority=0)],
        [Wait("high", 100, priority=5)],
        at(1),
        [],
        id="off-by-default",
    ),
    pytest.param(
        FAIR,
        1,
        [Run("high", 0, 100, priority=5)],
        [Wait("low", 100, priority=0)],
        at(minutes=500),
        [],
        id="never-for-a-lower-priority-head",
    ),
    pytest.param(
        ON,
        2,
        [Run("low", 0, 100, priority=0)],
        [Wait("high", 100, priority=5)],
        at(1),
        [],
        id="not-while-the-head-fits-a-gpu",
    ),
    pytest.param(
        ON,
        2,
        [Run("a", 0, 30), Run("b", 0, 30), Run("c", 0, 30), Run("big", 1, 100, since=at(60))],
        [Wait("head", 100, priority=5)],
        at(120),
        [("big", "head", 1, "priority")],
        id="smallest-victim-set-across-gpus",
    ),
    pytest.param(
        ON,
        1,
        [Run("sixty", 0, 60), Run("thirty", 0, 30), Run("ten", 0, 10)],
        [Wait("head", 40, priority=5)],
        at(1),
        [("sixty", "head", 0, "priority")],
        id="smallest-victim-set-on-one-gpu",
    ),
    pytest.param(
        ON,
        1,
        [Run("a", 0, 50, since=at(0)), Run("b", 0, 50, since=at(10))],
        [Wait("head", 100, priority=5)],
        at(20),
        [("a", "head", 0, "priority"), ("b", "head", 0, "priority")],
        id="two-victims-when-one-is-not-enough",
    ),
    pytest.param(
        ON,
        1,
        [Run("p1", 0, 50, priority=1, since=at(0)), Run("p0", 0, 50, priority=0, since=at(30))],
        [Wait("head", 50, priority=5)],
        at(60),
        [("p0", "head", 0, "priority")],
        id="prefer-lower-priority",
    ),
    pytest.param(
        ON,
        1,
        [Run("newer", 0, 50, since=at(30)), Run("older", 0, 50, since=at(0))],
        [Wait("head", 50, priority=5)],
        at(60),
        [("older", "head", 0, "priority")],
        id="then-the-longest-hold",
    ),
    pytest.param(
        ON,
        2,
        [Run("p1", 0, 100, priority=1, since=at(0)), Run("p0", 1, 100, priority=0, since=at(30))],
        [Wait("head", 100, priority=5)],
        at(60),
        [("p0", "head", 1, "priority")],
        id="prefer-lower-priority-across-gpus",
    ),
    pytest.param(
        ON,
        2,
        [Run("vip", 0, 50, priority=9), Run("low", 0, 50), Run("mid", 1, 100, priority=3)],
        [Wait("head", 100, priority=5)],
        at(1),
        [("mid", "head", 1, "priority")],
        id="an-ineligible-pod-shields-its-gpu",
    ),
    pytest.param(
        ON,
        1,
        [Run("vip", 0, 60, priority=9), Run("low", 0, 40)],
        [Wait("head", 100, priority=5)],
        at(1),
        [],
        id="no-set-frees-enough",
    ),
    pytest.param(
        FAIR,
        1,
        [Run("low", 0, 50, priority=0, since=at(1)), Run("peer", 0, 50, priority=5, since=at(0))],
        [Wait("head", 100, priority=5)],
        at(minutes=130),
        [("low", "head", 0, "priority"), ("peer", "head", 0, "max-duration")],
        id="priority-and-max-duration-victims-together",
    ),
    pytest.param(
        FAIR,
        1,
        [Run("low", 0, 50, priority=0, since=at(1)), Run("peer", 0, 50, priority=5, since=at(0))],
        [Wait("head", 100, priority=5)],
        at(minutes=100),
        [],
        id="an-equal-priority-pod-under-max-duration-is-not-a-victim",
    ),
]


@pytest.mark.parametrize(("qos", "gpus", "running", "waiting", "now", "expected"), PREEMPTION)
def test_plan_preemption(
    qos: QosConfig,
    gpus: int,
    running: list[Run],
    waiting: list[Wait],
    now: datetime,
    expected: Expected,
) -> None:
    gwt(
        given=topology(gpus, running, waiting, qos=qos),
        when=PlanPreemption(node=NODE),
        then=[
            Preempted(
                victim=ref(victim),
                preemptor=ref(preemptor),
                node=NODE,
                gpu_index=gpu,
                gpu_uuid=gpu_uuid(gpu),
                reason=reason,
            )
            for victim, preemptor, gpu, reason in expected
        ],
        now=now,
    )


def preempted(victim: str, preemptor: str, gpu: int = 0) -> Preempted:
    return Preempted(
        victim=ref(victim),
        preemptor=ref(preemptor),
        node=NODE,
        gpu_index=gpu,
        gpu_uuid=gpu_uuid(gpu),
        reason="priority",
    )


def test_the_victim_is_released_then_the_head_gets_its_gpu() -> None:
    given = topology(1, [Run("low", 0, 100)], [Wait("high", 100, priority=5)], qos=ON)
    gwt(given=given, when=PlanPreemption(node=NODE), then=[preempted("low", "high")])
    given = [*given, preempted("low", "high")]
    # The victim keeps its slot until its release is recorded.
    state = gwt(given=given, when=Schedule(node=NODE), then=[])
    assert state.pods[ref("low")].phase == "running"
    assert state.pods[ref("low")].evicted_by == ref("high")
    released = Released(
        pod=ref("low"), node=NODE, reason="preempted", gpu_index=0, gpu_uuid=gpu_uuid(0)
    )
    gwt(
        given=given,
        when=ReportRelease(pod=ref("low"), node=NODE, reason="preempted"),
        then=[released],
    )
    state = gwt(
        given=[*given, released],
        when=Schedule(node=NODE),
        then=[Assigned(pod=ref("high"), node=NODE, gpu_index=0, gpu_uuid=gpu_uuid(0))],
    )
    assert state.pods[ref("low")].phase == "dormant"
    assert state.pods[ref("low")].evicted_by is None


def test_only_one_preemption_in_flight_per_node() -> None:
    given = [
        *topology(
            2,
            [Run("low0", 0, 100), Run("low1", 1, 100)],
            [Wait("high", 100, priority=5), Wait("higher", 100, priority=9)],
            qos=ON,
        ),
    ]
    # "higher" is the head; it preempts one of the two; while that victim has not
    # released, nothing else is planned on the node, not even for the next head.
    gwt(given=given, when=PlanPreemption(node=NODE), then=[preempted("low0", "higher")])
    gwt(given=[*given, preempted("low0", "higher")], when=PlanPreemption(node=NODE), then=[])


def test_an_in_flight_preemption_on_another_node_does_not_block_this_one() -> None:
    other = "other-node"
    given = [
        *topology(1, [Run("low", 0, 100)], [Wait("high", 100, priority=5)], qos=ON),
        *topology(1, [Run("o-low", 0, 100)], [Wait("o-high", 100, priority=5)], qos=ON, node=other),
        Preempted(
            victim=ref("o-low"),
            preemptor=ref("o-high"),
            node=other,
            gpu_index=0,
            gpu_uuid=gpu_uuid(0, other),
            reason="priority",
        ),
    ]
    gwt(given=given, when=PlanPreemption(node=NODE), then=[preempted("low", "high")])
    gwt(given=given, when=PlanPreemption(node=other), then=[])


def test_static_pods_are_never_victims() -> None:
    given = [
        *node_events(1, policy="static", qos=FAIR),
        registered("static", 50, 100, policy="static"),
        Assigned(pod=ref("static"), node=NODE, gpu_index=0, gpu_uuid=gpu_uuid(0)),
    ]
    state = given_state(given)
    head = given_state(topology(1, [], [Wait("head", 100, priority=9)], qos=FAIR)).pods[ref("head")]
    node = state.nodes[NODE]
    assert eligibility(state.pods[ref("static")], head, node, at(minutes=1000)) is None
    # A static node never plans a preemption, and its pods never queue.
    gwt(given=given, when=RequestGpu(pod=ref("static"), node=NODE), then=[])
    gwt(given=given, when=PlanPreemption(node=NODE), then=[], now=at(minutes=1000))


def test_eligibility_reasons() -> None:
    state = given_state(
        topology(
            1,
            [Run("low", 0, 30, priority=0), Run("peer", 0, 30, priority=5), Run("vip", 0, 30, 9)],
            [Wait("head", 100, priority=5)],
            qos=FAIR,
        )
    )
    node, head = state.nodes[NODE], state.pods[ref("head")]
    reasons = {
        name: eligibility(state.pods[ref(name)], head, node, at(minutes=120))
        for name in ("low", "peer", "vip", "head")
    }
    assert reasons == {"low": "priority", "peer": "max-duration", "vip": None, "head": None}


def test_next_preemption_check_is_when_a_running_pod_crosses_pod_max_duration() -> None:
    given = topology(
        1,
        [Run("a", 0, 50, since=at(0)), Run("b", 0, 50, since=at(minutes=5))],
        [Wait("w", 100)],
        qos=FAIR,
    )
    state = given_state(given)
    assert next_preemption_check(state, NODE, at(1)) == at(minutes=120)
    assert next_preemption_check(state, NODE, at(minutes=120)) == at(minutes=125)
    assert next_preemption_check(state, NODE, at(minutes=125)) is None
    assert (
        next_preemption_check(given_state(topology(1, [Run("a", 0, 50)], qos=FAIR)), NODE, T0)
        is None
    )
    assert (
        next_preemption_check(
            given_state(topology(1, [Run("a", 0, 50)], [Wait("w", 100)], qos=ON)), NODE, T0
        )
        is None
    )


def test_fairness_preemption_requeues_the_victim_behind_those_waiting() -> None:
    # After podMaxDurationMinutes, an equal-priority waiter preempts; the victim's new
    # PodReady puts it behind the pods that were already waiting.
    given = topology(1, [Run("old", 0, 100)], [Wait("w1", 100), Wait("w2", 100)], qos=FAIR)
    now = at(minutes=120)
    plan = Preempted(
        victim=ref("old"),
        preemptor=ref("w1"),
        node=NODE,
        gpu_index=0,
        gpu_uuid=gpu_uuid(0),
        reason="max-duration",
    )
    gwt(given=given, when=PlanPreemption(node=NODE), then=[plan], now=now)
    released = Released(
        pod=ref("old"), node=NODE, reason="preempted", gpu_index=0, gpu_uuid=gpu_uuid(0)
    )
    assigned = Assigned(pod=ref("w1"), node=NODE, gpu_index=0, gpu_uuid=gpu_uuid(0))
    gwt(
        given=[*given, (now, plan), (now, released)],
        when=Schedule(node=NODE),
        then=[assigned],
        now=now,
    )
    state = gwt(
        given=[*given, (now, plan), (now, released), (now, assigned)],
        when=RequestGpu(pod=ref("old"), node=NODE),
        then=[PodReady(pod=ref("old"), node=NODE)],
        now=now,
    )
    assert queue_positions(state, NODE) == {ref("w2"): 1, ref("old"): 2}
