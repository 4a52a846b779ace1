"""The preemption timer's deadlines: a heap updated per node touched, not recomputed for all."""

from __future__ import annotations

from datetime import timedelta

from core_gwt import T0, given_state, gpu_uuid, node_events, ref, registered

from gpupool.core import PreemptionDeadlines, next_preemption_check
from gpupool.events import Assigned, Event, PodReady, QosConfig

QOS = QosConfig(preempt_enabled=True, pod_max_duration_minutes=10)


def busy_node(node: str, since_minutes: int, qos: QosConfig = QOS) -> list[Event]:
    """One pod running since ``since_minutes`` after T0, one waiting behind it."""
    runner, waiter = f"{node}-run", f"{node}-wait"
    return [
        *node_events(1, node=node, qos=qos),
        registered(runner, 1, 100, node=node),
        PodReady(pod=ref(runner), node=node),
        Assigned(pod=ref(runner), node=node, gpu_index=0, gpu_uuid=gpu_uuid(0, node)),
        registered(waiter, 1, 100, node=node),
        PodReady(pod=ref(waiter), node=node),
    ]


def test_the_earliest_deadline_is_the_nodes_minimum_and_updates_replace_it() -> None:
    given = [
        (T0 + timedelta(minutes=minutes), event)
        for node, minutes in (("a", 5), ("b", 1), ("c", 3))
        for event in busy_node(node, minutes)
    ]
    state = given_state(given)
    deadlines = PreemptionDeadlines()
    for node in ("a", "b", "c"):
        deadlines.update(state, node, T0)

    assert deadlines.earliest() == (next_preemption_check(state, "b", T0), "b")
    deadlines.passed("b")
    assert deadlines.earliest() == (next_preemption_check(state, "c", T0), "c")
    # c's waiter is gone: its deadline goes, a's is next
    state.pods[ref("c-wait")].phase = "dormant"
    deadlines.update(state, "c", T0)
    assert deadlines.earliest() == (next_preemption_check(state, "a", T0), "a")


def test_a_node_with_nobody_waiting_has_no_deadline() -> None:
    state = given_state(node_events(1, node="idle", qos=QOS))
    deadlines = PreemptionDeadlines()

    deadlines.update(state, "idle", T0)

    assert deadlines.earliest() is None


def test_only_a_node_that_holds_or_may_get_a_deadline_may_change_it() -> None:
    half_configured = {
        "no-limit": QosConfig(preempt_enabled=True),  # preemption on, no maximum duration
        "not-on": QosConfig(pod_max_duration_minutes=10),  # a maximum, preemption off
    }
    state = given_state(
        [
            (T0, event)
            for event in busy_node("on", 0)
            + busy_node("off", 0, QosConfig())
            + [e for node, qos in half_configured.items() for e in busy_node(node, 0, qos)]
        ]
    )
    deadlines = PreemptionDeadlines()

    # no fairness preemption configured: update cannot give it a deadline
    assert not deadlines.may_change(state, "off")
    for node in half_configured:  # each half of the configuration alone gives none either
        assert not deadlines.may_change(state, node)
        deadlines.update(state, node, T0)
        assert deadlines.earliest() is None
    deadlines.update(state, "off", T0)
    assert deadlines.earliest() is None
    assert not deadlines.may_change(state, "unknown-node")
    # configured: it may (here it does)
    assert deadlines.may_change(state, "on")
    deadlines.update(state, "on", T0)
    assert deadlines.earliest() is not None
    # a deadline held stays changeable even once the node's preemption is turned off
    state.nodes["on"].qos = QosConfig()
    assert deadlines.may_change(state, "on")
    deadlines.update(state, "on", T0)
    assert deadlines.earliest() is None
    assert not deadlines.may_change(state, "on")
