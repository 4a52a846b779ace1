"""The node status gpupool writes, computed purely (no I/O, time is an argument).

From the node's original capacity/allocatable, the configuration in force, the GPU
count and the reservation settings, ``status_patch`` computes exactly what the
documented format shows (docs/kubernetes.md). Enabled ``share-pool`` on a 16-GPU node with cpu 176,
memory 1800Gi, ephemeral-storage 6Ti and ``reservedEphemeralStorage: 1.5Ti``::

    allocatable: gpu-core.percentage "1600", gpu-memory.percentage "1600",
                 cpu "144", memory 1640Gi, nvidia.com/gpu "16", ephemeral-storage 4608Gi
    capacity:    the same share resources added; cpu/memory/storage unchanged
    conditions:  GPUSharePolicyValid True  Valid       "gpu share policy is valid."
                 GPUSharePolicy      True  share-pool  "gpu share policy is share-pool."

Disabled (``none``): the share resources are removed, the reserved CPU and memory
return to allocatable, and the conditions read ``GPUSharePolicyValid True Valid
"gpu share policy config is valid."`` and ``GPUSharePolicy False none "gpu share
policy is none."``. Disabled, the node keeps ``ephemeral-storage: 4608Gi``
allocatable (the sample node's): the storage reservation follows the QoS annotation, not the
label (``NodeStatusSettings.storage_reserved_while_disabled``, default True).

A refused configuration (bad label, bad annotation, exclusive-GPU pods present,
GPU-sharing pods still there) changes nothing in force: only
``GPUSharePolicyValid`` becomes False with the core's reason and message.

The reason of a valid configuration is ``Valid``, enabled or disabled.
"""

from __future__ import annotations

import json
from datetime import datetime
from decimal import Decimal

import msgspec

from gpupool.core.validation import (
    CORE_RESOURCE,
    EXCLUSIVE_GPU_RESOURCE,
    MEMORY_RESOURCE,
    POD_POLICIES,
    POLICY_LABEL,
    SHARE_RESOURCES,
    format_quantity,
    parse_quantity,
)
from gpupool.events import Policy
from gpupool.kube.records import (
    Node,
    NodeCondition,
    NodeStatus,
    NodeStatusPatch,
    ResourceList,
    kube_time,
)

VALID_CONDITION = "GPUSharePolicyValid"
POLICY_CONDITION = "GPUSharePolicy"
VALID_REASON = "Valid"
NONE_POLICY = "none"
ENABLED_VALID_MESSAGE = "gpu share policy is valid."
DISABLED_VALID_MESSAGE = "gpu share policy config is valid."

ORIGINAL_ALLOCATABLE_ANNOTATION = "gpupool.io/original-allocatable"
"""(ours) The node's allocatable cpu/memory/ephemeral-storage before gpupool reserved any.

Written once, before the first status patch that reserves; the reservation is
always computed from it, so re-applying never reserves twice."""

RESERVED_RESOURCES = ("cpu", "memory", "ephemeral-storage")
GPU_PERCENT = 100


def policy_message(policy: str) -> str:
    return f"gpu share policy is {policy}."


class NodeStatusSettings(msgspec.Struct, frozen=True, kw_only=True):
    """What an enabled node reserves for the GPU-share module, and how often to re-assert it."""

    reserved_cpu: str = "32"
    reserved_memory: str = "160Gi"
    storage_reserved_while_disabled: bool = True
    """Keep ``reservedEphemeralStorage`` reserved on a disabled node (the source's disabled sample)."""
    heartbeat_seconds: int = 300
    """Re-patch (refresh lastHeartbeatTime) when the conditions are older than this."""


# --------------------------------------------------------------------------- outcomes


class SharingEnabled(msgspec.Struct, frozen=True, kw_only=True):
    policy: Policy
    reserved_ephemeral_storage: str | None = None


class SharingDisabled(msgspec.Struct, frozen=True, kw_only=True):
    reserved_ephemeral_storage: str | None = None


class ConfigurationRefused(msgspec.Struct, frozen=True, kw_only=True):
    reason: str
    message: str


NodeOutcome = SharingEnabled | SharingDisabled | ConfigurationRefused


class OriginalResources(msgspec.Struct, frozen=True, kw_only=True):
    """Capacity and allocatable as the node had them without gpupool's changes."""

    capacity: ResourceList = {}
    allocatable: ResourceList = {}


# --------------------------------------------------------------------------- computing


def original_resources(node: Node) -> OriginalResources:
    capacity = {k: v for k, v in node.status.capacity.items() if k not in SHARE_RESOURCES}
    allocatable = {k: v for k, v in node.status.allocatable.items() if k not in SHARE_RESOURCES}
    recorded = _recorded_allocatable(node.metadata.annotations.get(ORIGINAL_ALLOCATABLE_ANNOTATION))
    allocatable.update(recorded)
    return OriginalResources(capacity=capacity, allocatable=allocatable)


def _recorded_allocatable(text: str | None) -> dict[str, str]:
    if not text:
        return {}
    try:
        raw = json.loads(text)
    except json.JSONDecodeError:
        return {}
    if not isinstance(raw, dict):
        return {}
    return {k: v for k, v in raw.items() if k in RESERVED_RESOURCES and isinstance(v, str)}


def original_allocatable_annotation(original: OriginalResources) -> str:
    """The value of ``gpupool.io/original-allocatable`` for these originals."""
    kept = {
        k: str(original.allocatable[k]) for k in RESERVED_RESOURCES if k in original.allocatable
    }
    return json.dumps(kept, separators=(",", ":"), sort_keys=True)


def gpu_count(node: Node) -> int:
    """GPUs the node advertises (capacity ``nvidia.com/gpu``); 0 when absent or unreadable."""
    value = node.status.capacity.get(EXCLUSIVE_GPU_RESOURCE)
    if value is None:
        return 0
    try:
        return int(parse_quantity(str(value)))
    except ValueError:
        return 0


def status_patch(
    original: OriginalResources,
    outcome: NodeOutcome,
    *,
    gpus: int,
    current: tuple[NodeCondition, ...],
    settings: NodeStatusSettings,
    now: datetime,
) -> NodeStatusPatch:
    """The status gpupool wants for a node (``current``: its conditions now, for transition times)."""
    match outcome:
        case SharingEnabled():
            share = str(GPU_PERCENT * gpus)
            reserve = {
                "cpu": settings.reserved_cpu,
                "memory": settings.reserved_memory,
                "ephemeral-storage": outcome.reserved_ephemeral_storage,
            }
            return NodeStatusPatch(
                capacity={CORE_RESOURCE: share, MEMORY_RESOURCE: share},
                allocatable={
                    **_reserved(original.allocatable, reserve),
                    CORE_RESOURCE: share,
                    MEMORY_RESOURCE: share,
                },
                conditions=_conditions(
                    current,
                    now,
                    valid=("True", VALID_REASON, ENABLED_VALID_MESSAGE),
                    policy=("True", outcome.policy, policy_message(outcome.policy)),
                ),
            )
        case SharingDisabled():
            storage = (
                outcome.reserved_ephemeral_storage
                if settings.storage_reserved_while_disabled
                else None
            )
            reserve = {"cpu": None, "memory": None, "ephemeral-storage": storage}
            return NodeStatusPatch(
                capacity={CORE_RESOURCE: None, MEMORY_RESOURCE: None},
                allocatable={
                    **_reserved(original.allocatable, reserve),
                    CORE_RESOURCE: None,
                    MEMORY_RESOURCE: None,
                },
                conditions=_conditions(
                    current,
                    now,
                    valid=("True", VALID_REASON, DISABLED_VALID_MESSAGE),
                    policy=("False", NONE_POLICY, policy_message(NONE_POLICY)),
                ),
            )
        case ConfigurationRefused():
            in_force = next((c for c in current if c.type == POLICY_CONDITION), None)
            policy = (
                (in_force.status, in_force.reason, in_force.message)
                if in_force is not None
                else ("False", NONE_POLICY, policy_message(NONE_POLICY))
            )
            return NodeStatusPatch(
                conditions=_conditions(
                    current,
                    now,
                    valid=("False", outcome.reason, outcome.message),
                    policy=policy,
                )
            )


def _reserved(allocatable: ResourceList, reserve: dict[str, str | None]) -> dict[str, str | None]:
    result: dict[str, str | None] = {}
    for resource, amount in reserve.items():
        if resource not in allocatable:
            continue
        value = parse_quantity(str(allocatable[resource]))
        if amount is not None:
            value = max(Decimal(0), value - parse_quantity(amount))
        result[resource] = _format(resource, value)
    return result


def _format(resource: str, value: Decimal) -> str:
    if resource == "cpu":
        if value == value.to_integral_value():
            return str(int(value))
        return f"{int(value * 1000)}m"
    return format_quantity(value, binary=True)


def _conditions(
    current: tuple[NodeCondition, ...],
    now: datetime,
    *,
    valid: tuple[str, str, str],
    policy: tuple[str, str, str],
) -> tuple[NodeCondition, ...]:
    stamp = kube_time(now)
    result = []
    for type_, (status, reason, message) in ((VALID_CONDITION, valid), (POLICY_CONDITION, policy)):
        before = next((c for c in current if c.type == type_), None)
        kept = before is not None and before.status == status and before.last_transition_time
        result.append(
            NodeCondition(
                type=type_,
                status=status,
                reason=reason,
                message=message,
                last_heartbeat_time=stamp,
                last_transition_time=before.last_transition_time if kept and before else stamp,
            )
        )
    return tuple(result)


def is_applied(
    status: NodeStatus, patch: NodeStatusPatch, *, settings: NodeStatusSettings, now: datetime
) -> bool:
    """Whether ``status`` already shows ``patch`` (times aside) with a fresh enough heartbeat."""
    for have, want in ((status.capacity, patch.capacity), (status.allocatable, patch.allocatable)):
        for resource, value in want.items():
            present = have.get(resource)
            if value is None or present is None:
                if value is not present:
                    return False
            elif not _same_quantity(present, value):
                return False
    for wanted in patch.conditions:
        found = next((c for c in status.conditions if c.type == wanted.type), None)
        if found is None or (found.status, found.reason, found.message) != (
            wanted.status,
            wanted.reason,
            wanted.message,
        ):
            return False
        if _age_seconds(found.last_heartbeat_time, now) >= settings.heartbeat_seconds:
            return False
    return True


def _same_quantity(a: str | int, b: str) -> bool:
    try:
        return parse_quantity(str(a)) == parse_quantity(b)
    except ValueError:
        return str(a) == b


def _age_seconds(stamp: str | None, now: datetime) -> float:
    if not stamp:
        return float("inf")
    try:
        then = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return float("inf")
    return (now - then).total_seconds()


# --------------------------------------------------------------------------- reading back


class NodeShareState(msgspec.Struct, frozen=True, kw_only=True):
    """A node's GPU-share state as its label and conditions tell it (what a scheduler reads)."""

    label: str | None
    """The ``alibabacloud.com/gpu-share-policy`` label as set (None: no label)."""
    in_force: Policy | None
    """The policy the ``GPUSharePolicy`` condition says is in force (None: not enabled)."""
    valid: bool
    """False when ``GPUSharePolicyValid`` is False."""
    invalid_reason: str = ""
    invalid_message: str = ""


def read_share_state(node: Node) -> NodeShareState:
    label = node.metadata.labels.get(POLICY_LABEL)
    policy = node.condition(POLICY_CONDITION)
    in_force: Policy | None = None
    if policy is not None and policy.status == "True":
        in_force = next((p for p in POD_POLICIES if p == policy.reason), None)
    valid = node.condition(VALID_CONDITION)
    if valid is not None and valid.status == "False":
        return NodeShareState(
            label=label,
            in_force=in_force,
            valid=False,
            invalid_reason=valid.reason,
            invalid_message=valid.message,
        )
    return NodeShareState(label=label, in_force=in_force, valid=True)
