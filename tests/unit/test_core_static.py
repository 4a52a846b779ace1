"""The static model (docs/behaviour.md): bound to one GPU at admission by requests, never queues."""

from __future__ import annotations

from core_gwt import (
    NODE,
    T0,
    given_state,
    gpu_uuid,
    gwt,
    manifest,
    node_events,
    only_event,
    ref,
    registered,
)

from gpupool.core import (
    STATUS_RUNNING,
    PlanPreemption,
    PodManifest,
    RegisterPod,
    RemovePod,
    ReportRelease,
    RequestGpu,
    Schedule,
    pooling_position,
    pooling_status,
    queue_positions,
)
from gpupool.core.validation import CORE_RESOURCE, MEMORY_RESOURCE
from gpupool.events import Assigned, Event, PodRejected, PodRemoved, QosConfig, Released

STATIC = node_events(
    2, policy="static", qos=QosConfig(preempt_enabled=True, pod_max_duration_minutes=1)
)


def static_manifest(name: str, request: int, limit: int = 100) -> PodManifest:
    return manifest(
        name,
        policy="static",
        requests={CORE_RESOURCE: request, MEMORY_RESOURCE: request},
        limits={CORE_RESOURCE: limit, MEMORY_RESOURCE: limit},
    )


def bound(name: str, request: int, gpu: int, limit: int = 100) -> list[Event]:
    return [
        registered(name, request, limit, policy="static"),
        Assigned(pod=ref(name), node=NODE, gpu_index=gpu, gpu_uuid=gpu_uuid(gpu)),
    ]


def test_a_static_pod_is_bound_to_a_gpu_when_it_is_admitted() -> None:
    state = gwt(
        given=STATIC,
        when=RegisterPod(manifest=static_manifest("a", 60)),
        then=bound("a", 60, 0),
    )
    pod = state.pods[ref("a")]
    assert (pod.phase, pod.gpu_index, pooling_status(pod)) == ("running", 0, STATUS_RUNNING)
    assert pooling_position(queue_positions(state, NODE), ref("a")) == 0


def test_static_pods_are_bound_by_requests_not_limits() -> None:
    # Two pods of request 50 / limit 100 share GPU 0: by requests it is exactly full.
    gwt(
        given=[*STATIC, *bound("a", 50, 0)],
        when=RegisterPod(manifest=static_manifest("b", 50)),
        then=bound("b", 50, 0),
    )
    # 60 + 60 > 100 by requests: the second goes to GPU 1; a third (30) goes best-fit to the fuller GPU.
    gwt(
        given=[*STATIC, *bound("a", 60, 0)],
        when=RegisterPod(manifest=static_manifest("b", 60)),
        then=bound("b", 60, 1),
    )
    gwt(
        given=[*STATIC, *bound("a", 60, 0), *bound("b", 70, 1)],
        when=RegisterPod(manifest=static_manifest("c", 30)),
        then=bound("c", 30, 1),
    )


def test_static_pods_never_queue_and_are_never_preempted() -> None:
    given = [*STATIC, *bound("a", 50, 0), *bound("b", 50, 0), *bound("c", 100, 1)]
    gwt(given=given, when=RequestGpu(pod=ref("a"), node=NODE), then=[])
    gwt(given=given, when=Schedule(node=NODE), then=[])
    state = gwt(given=given, when=PlanPreemption(node=NODE), then=[])
    assert queue_positions(state, NODE) == {}
    assert {p.ref.name: p.gpu_index for p in state.pods_on(NODE)} == {"a": 0, "b": 0, "c": 1}


def test_removing_a_static_pod_frees_its_gpu_once_its_end_is_recorded() -> None:
    given = [*STATIC, *bound("a", 100, 0), *bound("b", 100, 1)]
    state = given_state(given)
    assert state.nodes[NODE].allocatable_percent == 200
    gwt(
        given=given,
        when=RemovePod(pod=ref("a"), node=NODE),
        then=[PodRemoved(pod=ref("a"), node=NODE)],
    )
    removed = [*given, PodRemoved(pod=ref("a"), node=NODE)]
    assert given_state(removed).pods[ref("a")].releasing
    rejected = only_event(removed, RegisterPod(manifest=static_manifest("c", 100)))
    assert isinstance(rejected, PodRejected) and rejected.reason == "InsufficientAllocatable"
    ended = Released(pod=ref("a"), node=NODE, reason="cancelled", gpu_index=0)
    state = gwt(
        given=[*removed, ended],
        when=RegisterPod(manifest=static_manifest("c", 100)),
        then=bound("c", 100, 0),
    )
    assert ref("a") not in state.pods


def test_a_static_pods_end_is_recorded_and_it_keeps_its_gpu_for_the_next_run() -> None:
    """Finding 7: a static pod's out-of-memory end was not recorded at all."""
    given = [*STATIC, *bound("a", 50, 0)]
    state = gwt(
        given=given,
        when=ReportRelease(pod=ref("a"), node=NODE, reason="out-of-memory", exit_code=137),
        then=[
            Released(
                pod=ref("a"),
                node=NODE,
                reason="out-of-memory",
                gpu_index=0,
                gpu_uuid=gpu_uuid(0),
                exit_code=137,
            )
        ],
    )
    assert (state.pods[ref("a")].phase, state.pods[ref("a")].gpu_index) == ("dormant", 0)
    ended = [*given, Released(pod=ref("a"), node=NODE, reason="out-of-memory", gpu_index=0)]
    gwt(
        given=ended,
        when=RequestGpu(pod=ref("a"), node=NODE),
        then=[Assigned(pod=ref("a"), node=NODE, gpu_index=0, gpu_uuid=gpu_uuid(0))],
    )
    # its binding still counts while it does not run: a second pod of 60 goes to GPU 1
    gwt(given=ended, when=RegisterPod(manifest=static_manifest("b", 60)), then=bound("b", 60, 1))


def test_verify_accepts_a_static_pod_running_again_on_its_gpu() -> None:
    from gpupool.cli.audit import verify
    from gpupool.eventlog import StoredEvent
    from gpupool.events import Envelope

    events = [
        *STATIC,
        *bound("a", 60, 0),
        Released(pod=ref("a"), node=NODE, reason="completed", gpu_index=0, gpu_uuid=gpu_uuid(0)),
        Assigned(pod=ref("a"), node=NODE, gpu_index=0, gpu_uuid=gpu_uuid(0)),
    ]
    entries = [
        StoredEvent(
            seq=seq,
            subject="",
            envelope=Envelope(id=str(seq), time=T0, event=event),
        )
        for seq, event in enumerate(events, start=1)
    ]
    assert verify(entries).violations == []


def test_verify_accepts_a_bound_static_pod_losing_its_vanished_gpu() -> None:
    from gpupool.cli.audit import verify
    from gpupool.eventlog import StoredEvent
    from gpupool.events import Envelope

    events: list[Event] = [
        *STATIC,
        *bound("a", 60, 1),
        Released(pod=ref("a"), node=NODE, reason="completed", gpu_index=1, gpu_uuid=gpu_uuid(1)),
    ]
    state = given_state(events)
    from core_gwt import gpus

    from gpupool.core import ReportInventory, decide

    events += decide(state, ReportInventory(node=NODE, gpus=gpus(1), source="simulated"), T0)
    assert any(isinstance(e, Released) and e.reason == "gpu-vanished" for e in events)
    entries = [
        StoredEvent(seq=seq, subject="", envelope=Envelope(id=str(seq), time=T0, event=event))
        for seq, event in enumerate(events, start=1)
    ]
    assert verify(entries).violations == []
