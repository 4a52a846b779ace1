"""The node status gpupool writes, against the documented samples (byte for byte)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import msgspec
import pytest

from gpupool.kube.node_status import (
    ORIGINAL_ALLOCATABLE_ANNOTATION,
    ConfigurationRefused,
    NodeStatusSettings,
    SharingDisabled,
    SharingEnabled,
    is_applied,
    original_allocatable_annotation,
    original_resources,
    read_share_state,
    status_patch,
)
from gpupool.kube.records import Node, NodeCondition, NodeStatus, NodeStatusPatch, ObjectMeta

T0 = datetime(2025, 1, 7, 4, 13, 4, tzinfo=UTC)
SETTINGS = NodeStatusSettings()

# The documented node before the feature: capacity = allocatable.
ORIGINAL = {"cpu": "176", "memory": "1800Gi", "nvidia.com/gpu": "16", "ephemeral-storage": "6Ti"}
QOS_STORAGE = "1.5Ti"  # '{"preemptEnabled": true, "podMaxDurationMinutes": 120, "reservedEphemeralStorage": "1.5Ti"}'

# Source document, 手順 2 (enabled), status.allocatable / capacity / conditions.
ENABLED_ALLOCATABLE = {
    "alibabacloud.com/gpu-core.percentage": "1600",
    "alibabacloud.com/gpu-memory.percentage": "1600",
    "cpu": "144",
    "memory": "1640Gi",
    "nvidia.com/gpu": "16",
    "ephemeral-storage": "4608Gi",
}
ENABLED_CAPACITY = {
    "alibabacloud.com/gpu-core.percentage": "1600",
    "alibabacloud.com/gpu-memory.percentage": "1600",
    "cpu": "176",
    "memory": "1800Gi",
    "nvidia.com/gpu": "16",
    "ephemeral-storage": "6Ti",
}
ENABLED_CONDITIONS = [
    {
        "lastHeartbeatTime": "2025-01-07T04:13:04Z",
        "lastTransitionTime": "2025-01-07T04:13:04Z",
        "message": "gpu share policy is valid.",
        "reason": "Valid",  # the source prints "Valied": a typo (docs/kubernetes.md)
        "status": "True",
        "type": "GPUSharePolicyValid",
    },
    {
        "lastHeartbeatTime": "2025-01-07T04:13:04Z",
        "lastTransitionTime": "2025-01-07T04:13:04Z",
        "message": "gpu share policy is share-pool.",
        "reason": "share-pool",
        "status": "True",
        "type": "GPUSharePolicy",
    },
]
# Source document, 手順 5 (disabled).
DISABLED_ALLOCATABLE = {
    "cpu": "176",
    "memory": "1800Gi",
    "nvidia.com/gpu": "16",
    "ephemeral-storage": "4608Gi",
}
DISABLED_CAPACITY = {
    "cpu": "176",
    "memory": "1800Gi",
    "nvidia.com/gpu": "16",
    "ephemeral-storage": "6Ti",
}
DISABLED_CONDITIONS = [
    {
        "lastHeartbeatTime": "2025-01-07T04:13:04Z",
        "lastTransitionTime": "2025-01-07T04:13:04Z",
        "message": "gpu share policy config is valid.",
        "reason": "Valid",
        "status": "True",
        "type": "GPUSharePolicyValid",
    },
    {
        "lastHeartbeatTime": "2025-01-07T04:13:04Z",
        "lastTransitionTime": "2025-01-07T04:13:04Z",
        "message": "gpu share policy is none.",
        "reason": "none",
        "status": "False",
        "type": "GPUSharePolicy",
    },
]


def node(
    *,
    capacity: dict[str, str] | None = None,
    allocatable: dict[str, str] | None = None,
    conditions: tuple[NodeCondition, ...] = (),
    annotations: dict[str, str] | None = None,
) -> Node:
    return Node(
        metadata=ObjectMeta(name="cn-wulanchabu-c.cr-xxx", annotations=annotations or {}),
        status=NodeStatus(
            capacity=dict(ORIGINAL if capacity is None else capacity),
            allocatable=dict(ORIGINAL if allocatable is None else allocatable),
            conditions=conditions,
        ),
    )


def merged(have: dict[str, str | int], patch: dict[str, str | None]) -> dict[str, str | int]:
    """What a merge patch makes of ``have`` (None removes)."""
    result = dict(have)
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = value
    return result


def applied(before: Node, patch: NodeStatusPatch) -> Node:
    return Node(
        metadata=before.metadata,
        status=NodeStatus(
            capacity=merged(before.status.capacity, patch.capacity),
            allocatable=merged(before.status.allocatable, patch.allocatable),
            conditions=patch.conditions,
        ),
    )


def test_enabled_share_pool_is_the_source_sample() -> None:
    before = node()
    patch = status_patch(
        original_resources(before),
        SharingEnabled(policy="share-pool", reserved_ephemeral_storage=QOS_STORAGE),
        gpus=16,
        current=(),
        settings=SETTINGS,
        now=T0,
    )
    after = applied(before, patch)
    assert after.status.allocatable == ENABLED_ALLOCATABLE
    assert after.status.capacity == ENABLED_CAPACITY
    assert list(msgspec.to_builtins(after.status.conditions)) == ENABLED_CONDITIONS


def test_disabled_after_enabled_is_the_source_sample() -> None:
    original = node()
    enabled = applied(
        original,
        status_patch(
            original_resources(original),
            SharingEnabled(policy="share-pool", reserved_ephemeral_storage=QOS_STORAGE),
            gpus=16,
            current=(),
            settings=SETTINGS,
            now=T0,
        ),
    )
    # gpupool records the originals before reserving; read them back from the annotation.
    recorded = Node(
        metadata=ObjectMeta(
            name=enabled.name,
            annotations={
                ORIGINAL_ALLOCATABLE_ANNOTATION: original_allocatable_annotation(
                    original_resources(original)
                )
            },
        ),
        status=enabled.status,
    )
    patch = status_patch(
        original_resources(recorded),
        SharingDisabled(reserved_ephemeral_storage=QOS_STORAGE),
        gpus=16,
        current=recorded.status.conditions,
        settings=SETTINGS,
        now=T0,
    )
    after = applied(recorded, patch)
    assert after.status.allocatable == DISABLED_ALLOCATABLE
    assert after.status.capacity == DISABLED_CAPACITY
    assert list(msgspec.to_builtins(after.status.conditions)) == DISABLED_CONDITIONS


def test_transition_time_is_kept_while_the_status_does_not_change() -> None:
    t1 = T0 + timedelta(hours=1)
    enabled = status_patch(
        original_resources(node()),
        SharingEnabled(policy="share-pool"),
        gpus=16,
        current=(),
        settings=SETTINGS,
        now=T0,
    )
    disabled = status_patch(
        original_resources(node()),
        SharingDisabled(),
        gpus=16,
        current=enabled.conditions,
        settings=SETTINGS,
        now=t1,
    )
    valid, policy = disabled.conditions
    assert (valid.status, valid.last_transition_time, valid.last_heartbeat_time) == (
        "True",
        "2025-01-07T04:13:04Z",
        "2025-01-07T05:13:04Z",
    )
    assert (policy.status, policy.last_transition_time) == ("False", "2025-01-07T05:13:04Z")


def test_static_policy_reads_static() -> None:
    patch = status_patch(
        original_resources(node()),
        SharingEnabled(policy="static"),
        gpus=8,
        current=(),
        settings=SETTINGS,
        now=T0,
    )
    policy = patch.conditions[1]
    assert (policy.status, policy.reason, policy.message) == (
        "True",
        "static",
        "gpu share policy is static.",
    )
    assert patch.allocatable["alibabacloud.com/gpu-core.percentage"] == "800"
    assert patch.allocatable["ephemeral-storage"] == "6Ti"  # no reservedEphemeralStorage


def test_refused_configuration_changes_only_the_valid_condition() -> None:
    enabled = status_patch(
        original_resources(node()),
        SharingEnabled(policy="share-pool"),
        gpus=16,
        current=(),
        settings=SETTINGS,
        now=T0,
    )
    refused = status_patch(
        original_resources(node()),
        ConfigurationRefused(reason="InvalidQosConfig", message="annotation ... is not valid JSON"),
        gpus=16,
        current=enabled.conditions,
        settings=SETTINGS,
        now=T0 + timedelta(minutes=5),
    )
    assert refused.capacity == {} and refused.allocatable == {}
    valid, policy = refused.conditions
    assert (valid.status, valid.reason, valid.message) == (
        "False",
        "InvalidQosConfig",
        "annotation ... is not valid JSON",
    )
    assert valid.last_transition_time == "2025-01-07T04:18:04Z"
    assert (policy.status, policy.reason, policy.last_transition_time) == (
        "True",
        "share-pool",
        "2025-01-07T04:13:04Z",
    )


def test_refused_on_a_never_enabled_node_says_none() -> None:
    refused = status_patch(
        original_resources(node()),
        ConfigurationRefused(reason="InvalidPolicy", message="label ... is 'bogus'"),
        gpus=16,
        current=(),
        settings=SETTINGS,
        now=T0,
    )
    policy = refused.conditions[1]
    assert (policy.status, policy.reason, policy.message) == (
        "False",
        "none",
        "gpu share policy is none.",
    )


@pytest.mark.parametrize(
    ("settings", "cpu", "memory"),
    [
        pytest.param(NodeStatusSettings(), "144", "1640Gi", id="defaults-32-cpus-160Gi"),
        pytest.param(
            NodeStatusSettings(reserved_cpu="8500m", reserved_memory="64Gi"),
            "167500m",
            "1736Gi",
            id="configured",
        ),
        pytest.param(
            NodeStatusSettings(reserved_cpu="0", reserved_memory="0"), "176", "1800Gi", id="none"
        ),
    ],
)
def test_reservation_is_configurable(settings: NodeStatusSettings, cpu: str, memory: str) -> None:
    patch = status_patch(
        original_resources(node()),
        SharingEnabled(policy="share-pool"),
        gpus=16,
        current=(),
        settings=settings,
        now=T0,
    )
    assert (patch.allocatable["cpu"], patch.allocatable["memory"]) == (cpu, memory)


def test_storage_reservation_can_end_with_the_feature() -> None:
    patch = status_patch(
        original_resources(node()),
        SharingDisabled(reserved_ephemeral_storage=QOS_STORAGE),
        gpus=16,
        current=(),
        settings=NodeStatusSettings(storage_reserved_while_disabled=False),
        now=T0,
    )
    assert patch.allocatable["ephemeral-storage"] == "6Ti"


def test_reapplying_never_reserves_twice() -> None:
    before = node()
    first = status_patch(
        original_resources(before),
        SharingEnabled(policy="share-pool", reserved_ephemeral_storage=QOS_STORAGE),
        gpus=16,
        current=(),
        settings=SETTINGS,
        now=T0,
    )
    enabled = applied(before, first)
    recorded = Node(
        metadata=ObjectMeta(
            name=enabled.name,
            annotations={
                ORIGINAL_ALLOCATABLE_ANNOTATION: original_allocatable_annotation(
                    original_resources(before)
                )
            },
        ),
        status=enabled.status,
    )
    again = status_patch(
        original_resources(recorded),
        SharingEnabled(policy="share-pool", reserved_ephemeral_storage=QOS_STORAGE),
        gpus=16,
        current=recorded.status.conditions,
        settings=SETTINGS,
        now=T0,
    )
    assert again == first
    assert is_applied(recorded.status, again, settings=SETTINGS, now=T0)


def test_is_applied_wants_fresh_heartbeats_and_same_texts() -> None:
    before = node()
    patch = status_patch(
        original_resources(before),
        SharingEnabled(policy="share-pool"),
        gpus=16,
        current=(),
        settings=SETTINGS,
        now=T0,
    )
    after = applied(before, patch).status
    assert not is_applied(before.status, patch, settings=SETTINGS, now=T0)
    assert is_applied(after, patch, settings=SETTINGS, now=T0 + timedelta(seconds=299))
    assert not is_applied(after, patch, settings=SETTINGS, now=T0 + timedelta(seconds=300))
    # "1600" written, the API server may answer with the same quantity spelled otherwise
    respelled = NodeStatus(
        capacity={**after.capacity, "alibabacloud.com/gpu-core.percentage": "1.6k"},
        allocatable=after.allocatable,
        conditions=after.conditions,
    )
    assert is_applied(respelled, patch, settings=SETTINGS, now=T0)


def test_read_share_state_from_label_and_conditions() -> None:
    enabled = status_patch(
        original_resources(node()),
        SharingEnabled(policy="share-pool"),
        gpus=16,
        current=(),
        settings=SETTINGS,
        now=T0,
    )
    labelled = Node(
        metadata=ObjectMeta(name="n", labels={"alibabacloud.com/gpu-share-policy": "share-pool"}),
        status=NodeStatus(conditions=enabled.conditions),
    )
    state = read_share_state(labelled)
    assert (state.label, state.in_force, state.valid) == ("share-pool", "share-pool", True)
    refused = status_patch(
        original_resources(node()),
        ConfigurationRefused(reason="ExclusiveGpuPodsPresent", message="pods ..."),
        gpus=16,
        current=(),
        settings=SETTINGS,
        now=T0,
    )
    state = read_share_state(
        Node(metadata=ObjectMeta(name="n"), status=NodeStatus(conditions=refused.conditions))
    )
    assert (state.label, state.in_force, state.valid, state.invalid_reason) == (
        None,
        None,
        False,
        "ExclusiveGpuPodsPresent",
    )
