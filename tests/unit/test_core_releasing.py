"""Releasing, not gone: a slot stays counted until the end of its processes is recorded.

Also what an inventory change decides (GPUs that vanished, static pods waiting for a GPU).
Each test names the finding of issue 9 it covers; each failed before the change.
"""

from __future__ import annotations

from core_gwt import (
    NODE,
    T0,
    given_state,
    gpu_uuid,
    gpus,
    gwt,
    manifest,
    node_events,
    ref,
    registered,
)

from gpupool.core import (
    PodManifest,
    PresentPod,
    ReconcilePods,
    RegisterPod,
    ReportInventory,
    ReportRelease,
    Schedule,
    decide,
)
from gpupool.core.validation import CORE_RESOURCE, MEMORY_RESOURCE
from gpupool.events import (
    Assigned,
    Event,
    GpuInventoryReported,
    NodeConfigured,
    PodReady,
    PodRejected,
    PodRemoved,
    Released,
)


def static_manifest(name: str, request: int) -> PodManifest:
    return manifest(
        name,
        policy="static",
        requests={CORE_RESOURCE: request, MEMORY_RESOURCE: request},
        limits={CORE_RESOURCE: 100, MEMORY_RESOURCE: 100},
    )


def running(name: str, limit: int, gpu: int) -> list[Event]:
    return [
        registered(name, 1, limit),
        PodReady(pod=ref(name), node=NODE),
        Assigned(pod=ref(name), node=NODE, gpu_index=gpu, gpu_uuid=gpu_uuid(gpu)),
    ]


def test_a_deleted_running_pod_keeps_its_slot_until_its_end_is_recorded() -> None:
    """Finding 2: PodRemoved freed the slot while the executor was still ending the process."""
    given = [
        *node_events(1),
        *running("a", 100, 0),
        registered("b", 1, 100),
        PodReady(pod=ref("b"), node=NODE),
        PodRemoved(pod=ref("a"), node=NODE),
    ]
    state = given_state(given)
    assert state.pods[ref("a")].releasing
    gwt(given=given, when=Schedule(node=NODE), then=[])  # a's process may still use GPU 0
    ended = Released(pod=ref("a"), node=NODE, reason="cancelled", gpu_index=0)
    state = gwt(
        given=[*given, ended],
        when=Schedule(node=NODE),
        then=[Assigned(pod=ref("b"), node=NODE, gpu_index=0, gpu_uuid=gpu_uuid(0))],
    )
    assert ref("a") not in state.pods and ref("a") not in state.nodes[NODE].pods


def test_the_executor_records_the_end_of_a_deleted_pod() -> None:
    given = [*node_events(1), *running("a", 100, 0), PodRemoved(pod=ref("a"), node=NODE)]
    gwt(
        given=given,
        when=ReportRelease(pod=ref("a"), node=NODE, reason="cancelled", exit_code=143),
        then=[
            Released(
                pod=ref("a"),
                node=NODE,
                reason="cancelled",
                gpu_index=0,
                gpu_uuid=gpu_uuid(0),
                exit_code=143,
            )
        ],
    )


def test_a_shrunk_inventory_releases_what_held_a_vanished_gpu_and_never_chooses_it() -> None:
    """Finding 3: a pod on a GPU gone from the inventory crashed the scheduler (KeyError)."""
    given = [
        *node_events(2),
        *running("a", 100, 0),
        *running("b", 50, 1),
        registered("c", 1, 50),
        PodReady(pod=ref("c"), node=NODE),
    ]
    one_gpu = gpus(1)
    state = gwt(
        given=given,
        when=ReportInventory(node=NODE, gpus=one_gpu, source="simulated"),
        then=[
            GpuInventoryReported(node=NODE, gpus=one_gpu, source="simulated"),
            Released(
                pod=ref("b"),
                node=NODE,
                reason="gpu-vanished",
                gpu_index=1,
                gpu_uuid=gpu_uuid(1),
            ),
        ],
    )
    assert state.pods[ref("b")].phase == "dormant"
    # even a log that still has a pod on the vanished GPU does not crash the scheduler
    stale = [*given, GpuInventoryReported(node=NODE, gpus=one_gpu, source="simulated")]
    assert decide(given_state(stale), Schedule(node=NODE), T0) == []


def test_a_static_pod_bound_before_the_inventory_is_bound_when_it_arrives() -> None:
    """Finding 5: it was rejected as 'no GPU has room' and never retried."""
    enabled_without_inventory = [NodeConfigured(node=NODE, policy="static", gpu_count=2)]
    state = gwt(
        given=enabled_without_inventory,
        when=RegisterPod(manifest=static_manifest("a", 60)),
        then=[registered("a", 60, 100, policy="static")],
    )
    assert state.pods[ref("a")].gpu_index is None
    two = gpus(2)
    gwt(
        given=[*enabled_without_inventory, registered("a", 60, 100, policy="static")],
        when=ReportInventory(node=NODE, gpus=two, source="simulated"),
        then=[
            GpuInventoryReported(node=NODE, gpus=two, source="simulated"),
            Assigned(pod=ref("a"), node=NODE, gpu_index=0, gpu_uuid=gpu_uuid(0)),
        ],
    )


def test_a_waiting_static_pod_that_fits_no_gpu_of_the_inventory_is_told_so() -> None:
    enabled = [NodeConfigured(node=NODE, policy="static", gpu_count=2)]
    given = [
        *enabled,
        registered("a", 100, 100, policy="static"),
        registered("b", 100, 100, policy="static"),
    ]
    one = gpus(1)
    events = decide(
        given_state(given), ReportInventory(node=NODE, gpus=one, source="simulated"), T0
    )
    assert events[:2] == [
        GpuInventoryReported(node=NODE, gpus=one, source="simulated"),
        Assigned(pod=ref("a"), node=NODE, gpu_index=0, gpu_uuid=gpu_uuid(0)),
    ]
    assert isinstance(events[2], PodRejected) and events[2].reason == "NoStaticGpuFits"


def test_reconciling_removes_pods_the_cluster_no_longer_has_or_has_under_a_new_uid() -> None:
    """Finding 4: nothing compared the cluster's pods with the log's after the first list."""
    given = [
        *node_events(2),
        registered("kept", 1, 50),
        registered("gone", 1, 50),
        registered("recreated", 1, 50),
        *running("deleted-running", 50, 1),
    ]
    present = (
        PresentPod(pod=ref("kept"), uid="uid-kept"),
        PresentPod(pod=ref("recreated"), uid="a-new-uid"),
    )
    state = gwt(
        given=given,
        when=ReconcilePods(node=NODE, present=present),
        then=[
            PodRemoved(pod=ref("gone"), node=NODE),
            PodRemoved(pod=ref("recreated"), node=NODE),
            PodRemoved(pod=ref("deleted-running"), node=NODE),
        ],
    )
    assert set(state.pods) == {ref("kept"), ref("deleted-running")}
    assert state.pods[ref("deleted-running")].releasing  # until the executor ends it
    also_present = (
        *present,
        PresentPod(pod=ref("gone"), uid=""),  # no UID known: the name is enough
        PresentPod(pod=ref("deleted-running"), uid="uid-deleted-running"),
    )
    gwt(
        given=given,
        when=ReconcilePods(node=NODE, present=also_present),
        then=[PodRemoved(pod=ref("recreated"), node=NODE)],
    )
