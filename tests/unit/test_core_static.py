"""The static model (SPEC.md section 8): bound to one GPU at admission by requests, never queues."""

from __future__ import annotations

from core_gwt import NODE, given_state, gpu_uuid, gwt, manifest, node_events, ref, registered

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
from gpupool.events import Assigned, Event, PodRemoved, QosConfig

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


def test_static_pods_never_queue_and_are_never_preempted_or_released() -> None:
    given = [*STATIC, *bound("a", 50, 0), *bound("b", 50, 0), *bound("c", 100, 1)]
    gwt(given=given, when=RequestGpu(pod=ref("a"), node=NODE), then=[])
    gwt(given=given, when=ReportRelease(pod=ref("a"), node=NODE, reason="completed"), then=[])
    gwt(given=given, when=Schedule(node=NODE), then=[])
    state = gwt(given=given, when=PlanPreemption(node=NODE), then=[])
    assert queue_positions(state, NODE) == {}
    assert {p.ref.name: p.gpu_index for p in state.pods_on(NODE)} == {"a": 0, "b": 0, "c": 1}


def test_removing_a_static_pod_frees_its_gpu_for_the_next() -> None:
    given = [*STATIC, *bound("a", 100, 0), *bound("b", 100, 1)]
    state = given_state(given)
    assert state.nodes[NODE].allocatable_percent == 200
    gwt(
        given=given,
        when=RemovePod(pod=ref("a"), node=NODE),
        then=[PodRemoved(pod=ref("a"), node=NODE)],
    )
    gwt(
        given=[*given, PodRemoved(pod=ref("a"), node=NODE)],
        when=RegisterPod(manifest=static_manifest("c", 100)),
        then=bound("c", 100, 0),
    )
