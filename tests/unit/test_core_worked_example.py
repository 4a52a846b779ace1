"""docs/behaviour.md, the worked example, reproduced exactly: as given/when/then and as a scenario."""

from __future__ import annotations

from pathlib import Path

import msgspec
import yaml
from core_gwt import NODE, Given, at, gpu_uuid, gwt, node_events, ref, registered

from gpupool.core import (
    STATUS_READY,
    STATUS_RUNNING,
    PlanPreemption,
    ReportRelease,
    RequestGpu,
    Schedule,
    pooling_status,
    queue_positions,
)
from gpupool.core.simulation import Scenario, simulate
from gpupool.events import (
    Assigned,
    Event,
    PodReady,
    QosConfig,
    Released,
    encode_envelope,
)

SCENARIO = Path(__file__).resolve().parents[2] / "scenarios" / "worked-example.yaml"
QOS = QosConfig(
    preempt_enabled=True, pod_max_duration_minutes=120, reserved_ephemeral_storage="1.5Ti"
)
A, B, C, D = ref("pod-a"), ref("pod-b"), ref("pod-c"), ref("pod-d")


def assigned(pod: str, gpu: int) -> Assigned:
    return Assigned(pod=ref(pod), node=NODE, gpu_index=gpu, gpu_uuid=gpu_uuid(gpu))


SETUP: list[Event] = [
    *node_events(2, qos=QOS),
    registered("pod-a", 50, 50),
    registered("pod-b", 50, 50),
    registered("pod-c", 50, 100),
    registered("pod-d", 50, 100),
]
T1: list[Given] = [
    *SETUP,
    (at(0), PodReady(pod=A, node=NODE)),
    (at(0), assigned("pod-a", 0)),
    (at(1), PodReady(pod=C, node=NODE)),
    (at(1), assigned("pod-c", 1)),
    (at(2), PodReady(pod=D, node=NODE)),
    (at(3), PodReady(pod=B, node=NODE)),
]


def test_a_and_c_get_gpu_0_and_gpu_1() -> None:
    state = gwt(
        given=[*SETUP, PodReady(pod=A, node=NODE)],
        when=Schedule(node=NODE),
        then=[assigned("pod-a", 0)],
    )
    gwt(
        given=[
            *SETUP,
            PodReady(pod=A, node=NODE),
            assigned("pod-a", 0),
            PodReady(pod=C, node=NODE),
        ],
        when=Schedule(node=NODE),
        then=[assigned("pod-c", 1)],
    )
    assert state.pods[A].gpu_index == 0


def test_d_becomes_ready_and_b_joins_behind_it() -> None:
    state = gwt(given=T1[:-2], when=RequestGpu(pod=D, node=NODE), then=[PodReady(pod=D, node=NODE)])
    state = gwt(given=T1[:-1], when=RequestGpu(pod=B, node=NODE), then=[PodReady(pod=B, node=NODE)])
    assert queue_positions(state, NODE) == {D: 1, B: 2}


def test_t1_d_stays_queued_although_gpu_0_has_50_idle_and_b_waits_behind_it() -> None:
    # GPU 0 holds A (limit 50): D's request (50) would fit, its limit (100) does not;
    # B (limit 50) would fit on GPU 0 but the queue is served in order.
    state = gwt(given=T1, when=Schedule(node=NODE), then=[], now=at(4))
    assert queue_positions(state, NODE) == {D: 1, B: 2}
    assert pooling_status(state.pods[D]) == STATUS_READY
    assert pooling_status(state.pods[B]) == STATUS_READY
    # Equal priorities, no pod has held its GPU for 120 minutes: no preemption either.
    gwt(given=T1, when=PlanPreemption(node=NODE), then=[], now=at(4))


def test_t2_c_completes_and_goes_dormant() -> None:
    state = gwt(
        given=T1,
        when=ReportRelease(pod=C, node=NODE, reason="completed", exit_code=0),
        then=[
            Released(
                pod=C,
                node=NODE,
                reason="completed",
                gpu_index=1,
                gpu_uuid=gpu_uuid(1),
                exit_code=0,
            )
        ],
        now=at(60),
    )
    assert state.pods[C].phase == "dormant"
    assert state.pods[C].gpu_index is None


def test_t2_phase_1_d_gets_gpu_1_then_phase_2_b_runs_beside_a_on_gpu_0() -> None:
    released = Released(
        pod=C, node=NODE, reason="completed", gpu_index=1, gpu_uuid=gpu_uuid(1), exit_code=0
    )
    state = gwt(
        given=[*T1, (at(60), released)],
        when=Schedule(node=NODE),
        then=[assigned("pod-d", 1), assigned("pod-b", 0)],
        now=at(60),
    )
    assert {p: state.pods[p].gpu_index for p in (A, B, C, D)} == {A: 0, B: 0, C: None, D: 1}
    assert all(pooling_status(state.pods[p]) == STATUS_RUNNING for p in (A, B, D))
    assert queue_positions(state, NODE) == {}


def _worked_example() -> Scenario:
    return msgspec.convert(yaml.safe_load(SCENARIO.read_text()), Scenario)


def test_the_scenario_file_runs_the_worked_example_through_the_simulator() -> None:
    log = simulate(_worked_example())
    start = _worked_example().start
    placed = [
        (e.event.pod.name, e.event.gpu_index, (e.time - start).total_seconds())
        for e in log
        if isinstance(e.event, Assigned)
    ]
    assert placed == [
        ("pod-a", 0, 0.0),
        ("pod-c", 1, 1.0),
        ("pod-d", 1, 60.0),  # T2 phase 1
        ("pod-b", 0, 60.0),  # T2 phase 2
    ]
    released = [e.event for e in log if isinstance(e.event, Released)]
    assert [(r.pod.name, r.reason) for r in released] == [("pod-c", "completed")]
    # D's assignment follows C's release directly: nothing ran in between.
    index = next(i for i, e in enumerate(log) if isinstance(e.event, Released))
    following = log[index + 1].event
    assert isinstance(following, Assigned)
    assert following.pod == D


def test_the_simulation_is_deterministic_byte_for_byte() -> None:
    first = b"\n".join(encode_envelope(e) for e in simulate(_worked_example()))
    second = b"\n".join(encode_envelope(e) for e in simulate(_worked_example()))
    assert first == second
    assert first.count(b'"type":"Assigned"') == 4
