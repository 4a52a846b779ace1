"""Pods in Kubernetes mode, against kmock: registration, rejection Events, preemption records."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import kmock
from kube_harness import (
    POLICY_LABEL,
    QOS_ANNOTATION,
    SOURCE_NODE,
    SOURCE_QOS,
    PolicyInKubernetesMode,
    kubectl,
    node_object,
    policy_in_kubernetes_mode,
    share_pod,
)

from gpupool.core import PlanPreemption, ReportInventory, RequestGpu, Schedule
from gpupool.events import (
    Assigned,
    Envelope,
    GpuInfo,
    GpuInventoryReported,
    NodeConfigured,
    PodRef,
    PodRegistered,
    PodRejected,
    PodRemoved,
    Preempted,
    Share,
)

PODS = "/api/v1/namespaces/default/pods"


def registered(world: PolicyInKubernetesMode) -> dict[str, PodRegistered]:
    return {e.pod.name: e for e in world.core.events if isinstance(e, PodRegistered)}


def rejected(world: PolicyInKubernetesMode) -> dict[str, PodRejected]:
    return {e.pod.name: e for e in world.core.events if isinstance(e, PodRejected)}


def removed(world: PolicyInKubernetesMode) -> set[str]:
    return {e.pod.name for e in world.core.events if isinstance(e, PodRemoved)}


def events_about(world: PolicyInKubernetesMode, pod: str) -> list[dict[str, Any]]:
    return [e for e in world.events() if e["involvedObject"]["name"] == pod]


def gpu_enabled(world: PolicyInKubernetesMode) -> bool:
    return any(
        c["type"] == "GPUSharePolicy" and c["status"] == "True"
        for c in world.node().get("status", {}).get("conditions", [])
    )


async def test_bound_gpu_hpn_pods_are_registered_and_removed(
    kmock: kmock.KubernetesEmulator,
) -> None:
    await kubectl(kmock, "POST", "/api/v1/nodes", node_object(labels={POLICY_LABEL: "share-pool"}))
    await kubectl(kmock, "POST", PODS, share_pod("gpu-share-demo", priority=7))
    async with policy_in_kubernetes_mode(kmock) as world:
        await world.until(lambda: "gpu-share-demo" in registered(world))
        demo = registered(world)["gpu-share-demo"]
        assert (demo.node, demo.policy, demo.priority, demo.uid) == (
            SOURCE_NODE,
            "share-pool",
            7,
            "uid-default-gpu-share-demo",
        )
        assert (demo.requests.core, demo.requests.memory, demo.limits.core) == (10, 10, 100)

        # pending (not bound yet): nothing to register until the scheduler binds it
        await kubectl(kmock, "POST", PODS, share_pod("pending", node=""))
        await kubectl(kmock, "POST", PODS, share_pod("bound-later", node=""))
        await kubectl(kmock, "PATCH", f"{PODS}/bound-later", {"spec": {"nodeName": SOURCE_NODE}})
        await world.until(lambda: "bound-later" in registered(world))
        assert "pending" not in registered(world) and "pending" not in rejected(world)

        await kubectl(kmock, "DELETE", f"{PODS}/gpu-share-demo")
        await world.until(lambda: "gpu-share-demo" in removed(world))
        await kubectl(kmock, "PATCH", f"{PODS}/bound-later", {"status": {"phase": "Succeeded"}})
        await world.until(lambda: "bound-later" in removed(world))
        assert world.core.state.pods == {}
        assert world.events() == []


async def test_rejected_pods_get_a_warning_event(kmock: kmock.KubernetesEmulator) -> None:
    await kubectl(kmock, "POST", "/api/v1/nodes", node_object(labels={POLICY_LABEL: "share-pool"}))
    async with policy_in_kubernetes_mode(kmock) as world:
        await world.until(lambda: gpu_enabled(world))
        await kubectl(kmock, "POST", PODS, share_pod("wrong-model", policy="static"))
        await kubectl(kmock, "POST", PODS, share_pod("greedy", request=50, limit=10))
        await world.until(
            lambda: bool(events_about(world, "wrong-model")) and bool(events_about(world, "greedy"))
        )
        (mismatch,) = events_about(world, "wrong-model")
        assert mismatch["metadata"]["name"].startswith("wrong-model.")
        assert {k: v for k, v in mismatch.items() if k != "metadata"} == {
            "apiVersion": "v1",
            "kind": "Event",
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "namespace": "default",
                "name": "wrong-model",
                "uid": "uid-default-wrong-model",
            },
            "type": "Warning",
            "reason": "PolicyMismatch",
            "message": "pod policy 'static' does not match node 'cn-wulanchabu-c.cr-xxx' "
            "policy 'share-pool'",
            "source": {"component": "gpushare"},
            "reportingComponent": "gpupool",
            "firstTimestamp": "2025-01-07T04:13:04Z",
            "lastTimestamp": "2025-01-07T04:13:04Z",
            "count": 1,
        }
        (greedy,) = events_about(world, "greedy")
        assert (greedy["reason"], greedy["message"]) == (
            "LimitBelowRequest",
            "container 'demo' alibabacloud.com/gpu-core.percentage: limit 10 is below request 50",
        )
        # the core said why, once; status updates of the pod do not repeat it
        await kubectl(kmock, "PATCH", f"{PODS}/greedy", {"status": {"phase": "Pending"}})
        await kubectl(kmock, "POST", PODS, share_pod("fine"))
        await world.until(lambda: "fine" in registered(world))
        assert len(events_about(world, "greedy")) == 1
        assert [e.pod.name for e in world.core.events if isinstance(e, PodRejected)] == [
            "wrong-model",
            "greedy",
        ]


async def test_preemption_is_recorded_on_both_pods(kmock: kmock.KubernetesEmulator) -> None:
    await kubectl(
        kmock,
        "POST",
        "/api/v1/nodes",
        node_object(labels={POLICY_LABEL: "share-pool"}, annotations={QOS_ANNOTATION: SOURCE_QOS}),
    )
    await kubectl(kmock, "POST", PODS, share_pod("old-pod", request=50, limit=100, priority=0))
    await kubectl(kmock, "POST", PODS, share_pod("new-pod", request=50, limit=100, priority=10))
    async with policy_in_kubernetes_mode(kmock) as world:
        await world.until(lambda: {"old-pod", "new-pod"} <= set(registered(world)))
        # the node-executor's and the other services' commands, against the same core
        core = world.core
        old, new = (
            PodRef(namespace="default", name="old-pod"),
            PodRef(namespace="default", name="new-pod"),
        )
        gpu = GpuInfo(index=0, uuid="GPU-8f3c", memory_mib=81920)
        await core(ReportInventory(node=SOURCE_NODE, gpus=(gpu,), source="simulated"))
        await core(RequestGpu(pod=old, node=SOURCE_NODE))
        assert [type(e) for e in await core(Schedule(node=SOURCE_NODE))] == [Assigned]
        await core(RequestGpu(pod=new, node=SOURCE_NODE))
        assert await core(Schedule(node=SOURCE_NODE)) == []
        (preempted,) = await core(PlanPreemption(node=SOURCE_NODE))
        assert isinstance(preempted, Preempted)
        assert (preempted.victim, preempted.preemptor) == (old, new)

        when = datetime(2025, 4, 22, 8, 12, 9, 400000, tzinfo=UTC)
        logged = Envelope(id="0f6c9a7e-preempted", time=when, event=preempted)
        await world.controllers.preemptions.on_envelope(logged)

        (victim_event,) = events_about(world, "old-pod")
        (preemptor_event,) = events_about(world, "new-pod")
        assert _shown(victim_event) == (
            "Warning",
            "GPUSharePreempted",
            "gpushare",
            "GPU is preempted by new-pod.",
            "2025-04-22T08:12:09Z",
        )
        assert _shown(preemptor_event) == (
            "Warning",
            "GPUSharePreempt",
            "gpushare",
            "GPU is preempted from old-pod.",
            "2025-04-22T08:12:09Z",
        )
        assert victim_event["involvedObject"]["uid"] == "uid-default-old-pod"
        assert world.pod("old-pod")["status"]["conditions"] == [
            {
                "type": "Interruption.GPUShareReclaim",
                "status": "True",
                "reason": "GPUSharePreempted",
                "message": "GPU is preempted by new-pod.",
                "lastTransitionTime": "2025-04-22T08:12:09Z",
                "lastProbeTime": "2025-04-22T08:12:09Z",
            }
        ]
        assert world.pod("new-pod")["status"]["conditions"] == [
            {
                "type": "Interruption.GPUShareReclaim",
                "status": "True",
                "reason": "GPUSharePreempt",
                "message": "GPU is preempted from old-pod.",
                "lastTransitionTime": "2025-04-22T08:12:09Z",
                "lastProbeTime": "2025-04-22T08:12:09Z",
            }
        ]

        # replaying the log records nothing twice
        await world.controllers.preemptions.on_envelope(logged)
        assert len(events_about(world, "old-pod")) == 1
        assert len(events_about(world, "new-pod")) == 1


async def test_preemption_of_a_deleted_pod_still_records_the_rest(
    kmock: kmock.KubernetesEmulator,
) -> None:
    await kubectl(kmock, "POST", PODS, share_pod("survivor", node=""))
    async with policy_in_kubernetes_mode(kmock) as world:
        gone, survivor = (
            PodRef(namespace="default", name="gone"),
            PodRef(namespace="default", name="survivor"),
        )
        preempted = Preempted(
            victim=gone,
            preemptor=survivor,
            node=SOURCE_NODE,
            gpu_index=0,
            gpu_uuid="GPU-0",
            reason="priority",
        )
        when = datetime(2025, 4, 22, 8, 12, 9, tzinfo=UTC)
        await world.controllers.preemptions.record(preempted, when, log_id="entry-7")
        assert [e["reason"] for e in world.events()] == ["GPUSharePreempted", "GPUSharePreempt"]
        assert world.pod("survivor")["status"]["conditions"][0]["reason"] == "GPUSharePreempt"


def _shown(event: dict[str, Any]) -> tuple[str, str, str, str, str]:
    """What ``kubectl describe pod`` prints: type, reason, from, message (and when)."""
    return (
        event["type"],
        event["reason"],
        event["source"]["component"],
        event["message"],
        event["lastTimestamp"],
    )


def logged_pod(name: str, uid: str) -> PodRegistered:
    return PodRegistered(
        pod=PodRef(namespace="default", name=name),
        node=SOURCE_NODE,
        policy="share-pool",
        requests=Share(core=10, memory=10),
        limits=Share(core=100, memory=100),
        uid=uid,
    )


async def test_at_start_the_log_is_reconciled_with_the_cluster(
    kmock: kmock.KubernetesEmulator,
) -> None:
    """Finding 4: pods deleted while the policy service was down stayed registered for ever,
    and a pod recreated under the same name was refused as AlreadyRegistered."""
    await kubectl(kmock, "POST", "/api/v1/nodes", node_object(labels={POLICY_LABEL: "share-pool"}))
    await kubectl(kmock, "POST", PODS, share_pod("recreated"))
    before_restart = [
        GpuInventoryReported(
            node=SOURCE_NODE,
            gpus=(GpuInfo(index=0, uuid="GPU-0", memory_mib=81920),),
            source="simulated",
        ),
        NodeConfigured(node=SOURCE_NODE, policy="share-pool", gpu_count=1),
        logged_pod("gone", "uid-of-a-deleted-pod"),
        logged_pod("recreated", "uid-of-the-earlier-recreated"),
    ]
    async with policy_in_kubernetes_mode(kmock, logged=before_restart) as world:
        await world.until(lambda: "recreated" in registered(world))
        assert removed(world) >= {"gone", "recreated"}
        assert registered(world)["recreated"].uid == "uid-default-recreated"
        assert "recreated" not in rejected(world)
        assert set(p.name for p in world.core.state.pods) == {"recreated"}
