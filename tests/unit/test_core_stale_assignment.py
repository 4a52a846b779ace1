"""An Assigned that reaches the log after an entry its decider did not see claims nothing.

The admission-queue's expectation covers only the node's other claims (docs/eventlog.md),
so a cancellation, a deletion or a vanished GPU may land between its decision and its
append. The fold is then the same on every replica: the stale Assigned is a no-op, and
no GPU ever holds more than its capacity, whatever order the claims arrive in.
"""

from __future__ import annotations

from core_gwt import NODE, T0, given_state, gpu_uuid, gpus, node_events, ref, registered

from gpupool.core import State, assignment_holds, evolve, gpu_usage
from gpupool.events import (
    Assigned,
    Envelope,
    Event,
    GpuInventoryReported,
    PodReady,
    PodRemoved,
    Released,
)
from gpupool.runtime.statistics import LogStatistics


def assigned(name: str, gpu: int = 0) -> Assigned:
    return Assigned(pod=ref(name), node=NODE, gpu_index=gpu, gpu_uuid=gpu_uuid(gpu))


def waiting(name: str, limit: int = 60) -> list[Event]:
    return [registered(name, 1, limit), PodReady(pod=ref(name), node=NODE)]


def fold_onto(state: State, *events: Event) -> State:
    for index, event in enumerate(events):
        evolve(state, Envelope(id=f"late-{index}", time=T0, event=event))
    return state


def test_an_assigned_for_a_pod_that_cancelled_meanwhile_is_a_no_op() -> None:
    state = given_state([*node_events(1), *waiting("a")])
    fold_onto(state, Released(pod=ref("a"), node=NODE, reason="cancelled"))

    fold_onto(state, assigned("a"))

    pod = state.pods[ref("a")]
    assert (pod.phase, pod.gpu_index, pod.running_since) == ("dormant", None, None)
    assert gpu_usage(state.nodes[NODE], state.pods_on(NODE))[0].core == 0


def test_an_assigned_for_a_pod_deleted_and_registered_again_does_not_start_it() -> None:
    state = given_state([*node_events(1), *waiting("a")])
    fold_onto(state, PodRemoved(pod=ref("a"), node=NODE), registered("a", 1, 60))

    fold_onto(state, assigned("a"))

    assert state.pods[ref("a")].phase == "dormant"


def test_an_assigned_on_a_gpu_that_vanished_meanwhile_is_a_no_op() -> None:
    state = given_state([*node_events(2), *waiting("a")])
    fold_onto(state, GpuInventoryReported(node=NODE, gpus=gpus(1), source="simulated"))

    fold_onto(state, assigned("a", gpu=1))

    assert state.pods[ref("a")].phase == "ready"


def test_of_two_claims_decided_on_the_same_state_only_the_first_folded_holds() -> None:
    state = given_state([*node_events(1), *waiting("a"), *waiting("b")])
    # two deciders each saw one free GPU and put their pod on it (60 + 60 > 100)
    fold_onto(state, assigned("a"), assigned("b"))

    assert state.pods[ref("a")].phase == "running"
    assert state.pods[ref("b")].phase == "ready"
    assert gpu_usage(state.nodes[NODE], state.pods_on(NODE))[0].core == 60


def test_a_claim_that_fits_beside_the_running_pods_holds() -> None:
    state = given_state([*node_events(1), *waiting("a", 40), *waiting("b", 60)])

    fold_onto(state, assigned("a"), assigned("b"))

    assert [state.pods[ref(name)].phase for name in ("a", "b")] == ["running", "running"]


def test_a_static_binding_holds_for_a_registered_pod() -> None:
    state = given_state([*node_events(1, policy="static"), registered("s", 30, policy="static")])

    assert assignment_holds(state, assigned("s"))
    fold_onto(state, assigned("s"))
    assert state.pods[ref("s")].gpu_index == 0


def test_the_metrics_do_not_count_an_assignment_that_did_not_hold() -> None:
    state = given_state([*node_events(1), *waiting("a")])
    fold_onto(state, Released(pod=ref("a"), node=NODE, reason="cancelled"))
    statistics = LogStatistics()

    statistics.observe(state, Envelope(id="late", time=T0, event=assigned("a")), 99)

    assert statistics.nodes.get(NODE) is None or statistics.nodes[NODE].assignments == 0
