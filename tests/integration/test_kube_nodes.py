"""Node enablement in Kubernetes mode, against kmock: the documented node status."""

from __future__ import annotations

from typing import Any

import kmock
import yaml
from kube_harness import (
    POLICY_LABEL,
    QOS_ANNOTATION,
    SOURCE_NODE,
    SOURCE_QOS,
    exclusive_pod,
    kubectl,
    node_object,
    policy_in_kubernetes_mode,
)

from gpupool.events import NodeConfigured, NodeDisabled, NodeRejected

# The documented expected outputs, verbatim (手順 2 and 手順 5), except that the
# enabled sample's reason "Valied" is a typo for "Valid" (docs/kubernetes.md).
SOURCE_ENABLED = yaml.safe_load(
    """
status:
  allocatable:
    alibabacloud.com/gpu-core.percentage: "1600"
    alibabacloud.com/gpu-memory.percentage: "1600"
    cpu: "144"
    memory: 1640Gi
    nvidia.com/gpu: "16"
    ephemeral-storage: 4608Gi
  capacity:
    alibabacloud.com/gpu-core.percentage: "1600"
    alibabacloud.com/gpu-memory.percentage: "1600"
    cpu: "176"
    memory: 1800Gi
    nvidia.com/gpu: "16"
    ephemeral-storage: 6Ti
  conditions:
  - lastHeartbeatTime: "2025-01-07T04:13:04Z"
    lastTransitionTime: "2025-01-07T04:13:04Z"
    message: gpu share policy is valid.
    reason: Valied
    status: "True"
    type: GPUSharePolicyValid
  - lastHeartbeatTime: "2025-01-07T04:13:04Z"
    lastTransitionTime: "2025-01-07T04:13:04Z"
    message: gpu share policy is share-pool.
    reason: share-pool
    status: "True"
    type: GPUSharePolicy
""".replace("reason: Valied", "reason: Valid")
)["status"]

SOURCE_DISABLED = yaml.safe_load(
    """
status:
  allocatable:
    cpu: "176"
    memory: 1800Gi
    nvidia.com/gpu: "16"
    ephemeral-storage: 4608Gi
  capacity:
    cpu: "176"
    memory: 1800Gi
    nvidia.com/gpu: "16"
    ephemeral-storage: 6Ti
  conditions:
  - lastHeartbeatTime: "2025-01-07T04:13:04Z"
    lastTransitionTime: "2025-01-07T04:13:04Z"
    message: gpu share policy config is valid.
    reason: Valid
    status: "True"
    type: GPUSharePolicyValid
  - lastHeartbeatTime: "2025-01-07T04:13:04Z"
    lastTransitionTime: "2025-01-07T04:13:04Z"
    message: gpu share policy is none.
    reason: none
    status: "False"
    type: GPUSharePolicy
"""
)["status"]


def conditions(node: dict[str, Any]) -> dict[str, dict[str, str]]:
    return {c["type"]: c for c in node.get("status", {}).get("conditions", [])}


def label(value: str) -> dict[str, Any]:
    return {"metadata": {"labels": {POLICY_LABEL: value}}}


async def test_enable_and_disable_show_the_source_documents_status(
    kmock: kmock.KubernetesEmulator,
) -> None:
    await kubectl(
        kmock, "POST", "/api/v1/nodes", node_object(annotations={QOS_ANNOTATION: SOURCE_QOS})
    )
    async with policy_in_kubernetes_mode(kmock) as world:
        # kubectl label node cn-wulanchabu-c.cr-xxx alibabacloud.com/gpu-share-policy=share-pool
        await kubectl(kmock, "PATCH", f"/api/v1/nodes/{SOURCE_NODE}", label("share-pool"))
        await world.until(
            lambda: conditions(world.node()).get("GPUSharePolicy", {}).get("status") == "True"
        )
        assert world.node()["status"] == SOURCE_ENABLED
        assert [type(e) for e in world.core.events] == [NodeConfigured]
        configured = world.core.events[0]
        assert isinstance(configured, NodeConfigured)
        assert (configured.policy, configured.gpu_count) == ("share-pool", 16)
        assert configured.qos.reserved_ephemeral_storage == "1.5Ti"

        # kubectl label node cn-wulanchabu-c.cr-xxx alibabacloud.com/gpu-share-policy=none
        await kubectl(kmock, "PATCH", f"/api/v1/nodes/{SOURCE_NODE}", label("none"))
        await world.until(
            lambda: conditions(world.node()).get("GPUSharePolicy", {}).get("status") == "False"
        )
        assert world.node()["status"] == SOURCE_DISABLED
        assert isinstance(world.core.events[-1], NodeDisabled)
        # what gpupool remembered of the node before it reserved anything
        assert world.node()["metadata"]["annotations"]["gpupool.io/original-allocatable"] == (
            '{"cpu":"176","ephemeral-storage":"6Ti","memory":"1800Gi"}'
        )


async def test_transition_times_move_only_when_the_status_changes(
    kmock: kmock.KubernetesEmulator,
) -> None:
    await kubectl(kmock, "POST", "/api/v1/nodes", node_object(labels={POLICY_LABEL: "static"}))
    async with policy_in_kubernetes_mode(kmock) as world:
        await world.until(lambda: "GPUSharePolicy" in conditions(world.node()))
        policy = conditions(world.node())["GPUSharePolicy"]
        assert (policy["status"], policy["reason"], policy["message"]) == (
            "True",
            "static",
            "gpu share policy is static.",
        )
        world.clock.advance(minutes=30)
        await kubectl(kmock, "PATCH", f"/api/v1/nodes/{SOURCE_NODE}", label("none"))
        await world.until(lambda: conditions(world.node())["GPUSharePolicy"]["status"] == "False")
        valid = conditions(world.node())["GPUSharePolicyValid"]
        policy = conditions(world.node())["GPUSharePolicy"]
        assert (valid["lastTransitionTime"], valid["lastHeartbeatTime"]) == (
            "2025-01-07T04:13:04Z",
            "2025-01-07T04:43:04Z",
        )
        assert (policy["lastTransitionTime"], policy["lastHeartbeatTime"]) == (
            "2025-01-07T04:43:04Z",
            "2025-01-07T04:43:04Z",
        )
        # static reserved no storage (no QoS annotation): allocatable is back to the original
        assert world.node()["status"]["allocatable"] == {
            "cpu": "176",
            "memory": "1800Gi",
            "nvidia.com/gpu": "16",
            "ephemeral-storage": "6Ti",
        }


async def test_invalid_qos_annotation_makes_the_policy_invalid_with_the_reason(
    kmock: kmock.KubernetesEmulator,
) -> None:
    await kubectl(
        kmock,
        "POST",
        "/api/v1/nodes",
        node_object(
            labels={POLICY_LABEL: "share-pool"},
            annotations={QOS_ANNOTATION: '{"preemptEnabled": "yes", "podMaxDurationMinutes": 120}'},
        ),
    )
    async with policy_in_kubernetes_mode(kmock) as world:
        await world.until(lambda: "GPUSharePolicyValid" in conditions(world.node()))
        valid = conditions(world.node())["GPUSharePolicyValid"]
        assert (valid["status"], valid["reason"], valid["message"]) == (
            "False",
            "InvalidQosConfig",
            'annotation alibabacloud.com/gpu-share-qos-config preemptEnabled must be a bool, not "yes"',
        )
        policy = conditions(world.node())["GPUSharePolicy"]
        assert (policy["status"], policy["reason"]) == ("False", "none")
        assert "alibabacloud.com/gpu-core.percentage" not in world.node()["status"]["capacity"]
        assert world.node()["status"]["allocatable"]["cpu"] == "176"

        # fixing the annotation enables the node
        await kubectl(
            kmock,
            "PATCH",
            f"/api/v1/nodes/{SOURCE_NODE}",
            {"metadata": {"annotations": {QOS_ANNOTATION: SOURCE_QOS}}},
        )
        await world.until(
            lambda: conditions(world.node())["GPUSharePolicyValid"]["status"] == "True"
        )
        assert world.node()["status"] == SOURCE_ENABLED


async def test_invalid_label_is_reported_and_nothing_is_enabled(
    kmock: kmock.KubernetesEmulator,
) -> None:
    await kubectl(kmock, "POST", "/api/v1/nodes", node_object(labels={POLICY_LABEL: "shared"}))
    async with policy_in_kubernetes_mode(kmock) as world:
        await world.until(lambda: "GPUSharePolicyValid" in conditions(world.node()))
        valid = conditions(world.node())["GPUSharePolicyValid"]
        assert (valid["status"], valid["reason"], valid["message"]) == (
            "False",
            "InvalidPolicy",
            "label alibabacloud.com/gpu-share-policy is 'shared'; it must be one of share-pool, static, none",
        )
        assert world.node()["status"]["capacity"] == {
            "cpu": "176",
            "memory": "1800Gi",
            "nvidia.com/gpu": "16",
            "ephemeral-storage": "6Ti",
        }


async def test_exclusive_gpu_pods_block_enabling_until_they_are_gone(
    kmock: kmock.KubernetesEmulator,
) -> None:
    await kubectl(kmock, "POST", "/api/v1/nodes", node_object())
    await kubectl(
        kmock, "POST", "/api/v1/namespaces/default/pods", exclusive_pod("trainer", gpus=8)
    )
    # CPU/memory-only pods may stay (手順 1)
    await kubectl(
        kmock,
        "POST",
        "/api/v1/namespaces/default/pods",
        {
            "metadata": {"name": "web", "namespace": "default", "uid": "uid-web"},
            "spec": {
                "nodeName": SOURCE_NODE,
                "containers": [{"name": "web", "resources": {"requests": {"cpu": "1"}}}],
            },
        },
    )
    async with policy_in_kubernetes_mode(kmock) as world:
        await kubectl(kmock, "PATCH", f"/api/v1/nodes/{SOURCE_NODE}", label("share-pool"))
        await world.until(lambda: "GPUSharePolicyValid" in conditions(world.node()))
        valid = conditions(world.node())["GPUSharePolicyValid"]
        assert (valid["status"], valid["reason"], valid["message"]) == (
            "False",
            "ExclusiveGpuPodsPresent",
            "cannot enable share-pool on cn-wulanchabu-c.cr-xxx: pods requesting whole GPUs "
            "(nvidia.com/gpu) still run there: default/trainer",
        )
        assert conditions(world.node())["GPUSharePolicy"]["status"] == "False"
        assert isinstance(world.core.events[-1], NodeRejected)

        await kubectl(kmock, "DELETE", "/api/v1/namespaces/default/pods/trainer")
        await world.until(
            lambda: conditions(world.node())["GPUSharePolicyValid"]["status"] == "True"
        )
        assert conditions(world.node())["GPUSharePolicy"]["reason"] == "share-pool"
        assert (
            world.node()["status"]["allocatable"]["alibabacloud.com/gpu-core.percentage"] == "1600"
        )
        # no QoS annotation: no storage reserved
        assert world.node()["status"]["allocatable"]["ephemeral-storage"] == "6Ti"


async def test_an_exclusive_pod_bound_to_an_enabled_node_does_not_disable_it(
    kmock: kmock.KubernetesEmulator,
) -> None:
    await kubectl(kmock, "POST", "/api/v1/nodes", node_object(labels={POLICY_LABEL: "share-pool"}))
    async with policy_in_kubernetes_mode(kmock) as world:
        await world.until(
            lambda: conditions(world.node()).get("GPUSharePolicy", {}).get("status") == "True"
        )
        submitted = len(world.core.commands)
        await kubectl(kmock, "POST", "/api/v1/namespaces/default/pods", exclusive_pod("late"))
        await world.until(lambda: len(world.core.commands) > submitted)
        assert conditions(world.node())["GPUSharePolicy"]["status"] == "True"
        assert conditions(world.node())["GPUSharePolicyValid"]["status"] == "True"
