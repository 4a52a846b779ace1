"""Which nodes a pod may go to, and which it should prefer. Pure: nodes, pods and usage in, verdicts out.

Filter (SPEC.md section 6, ours):

* A pod asking for whole GPUs (``nvidia.com/gpu``, no share resources) is kept
  off every node where GPU sharing is on or being turned on: the node's label
  asks for ``share-pool``/``static``, or its ``GPUSharePolicy`` condition says a
  policy is in force. (Label or condition: a node whose label was just set must
  not take new whole-GPU pods, or they would block its enabling forever.)
* A GPU-sharing pod is kept off nodes where sharing is not in force (condition
  ``GPUSharePolicy`` not True), where the policy in force or the label differs
  from the pod's ``alibabacloud.com/gpu-share-policy``, where
  ``GPUSharePolicyValid`` is False, and where its requests do not fit: the
  node's allocatable ``gpu-core.percentage`` / ``gpu-memory.percentage`` minus
  the requests of the GPU-sharing pods already bound there.
* A pod that asks for share resources but is not a valid GPU-sharing pod is
  kept off every node, with the core's reason.
* Any other pod passes.

Prioritize: best fit. A GPU-sharing pod scores a node by how full the node's
share resources will be once the pod is placed (mean of compute and memory,
0..10): partly used nodes fill up before empty ones, which keeps whole nodes
free for large pods and avoids spreading small pods thin. Other pods score 0
everywhere (no preference).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from fractions import Fraction

import msgspec

from gpupool.core import PodSpec, Rejection, validate_pod
from gpupool.core.validation import (
    CORE_RESOURCE,
    EXCLUSIVE_GPU_RESOURCE,
    MEMORY_RESOURCE,
    parse_quantity,
)
from gpupool.events import Share
from gpupool.extender.protocol import MAX_EXTENDER_PRIORITY, HostPriority
from gpupool.kube.node_status import read_share_state
from gpupool.kube.pod_directory import asks_exclusive_gpu, asks_gpu_share, pod_manifest
from gpupool.kube.records import Node, Pod

ShareUsage = Callable[[str], Share]
"""Requests of the GPU-sharing pods already bound to a node, by node name."""


class ExclusiveGpuPod(msgspec.Struct, frozen=True, kw_only=True):
    pass


class GpuSharePod(msgspec.Struct, frozen=True, kw_only=True):
    spec: PodSpec


class InvalidGpuSharePod(msgspec.Struct, frozen=True, kw_only=True):
    rejection: Rejection


class OtherPod(msgspec.Struct, frozen=True, kw_only=True):
    pass


PodKind = ExclusiveGpuPod | GpuSharePod | InvalidGpuSharePod | OtherPod


def classify(pod: Pod) -> PodKind:
    if asks_gpu_share(pod):
        spec = validate_pod(pod_manifest(pod))
        if isinstance(spec, Rejection):
            return InvalidGpuSharePod(rejection=spec)
        return GpuSharePod(spec=spec)
    if asks_exclusive_gpu(pod):
        return ExclusiveGpuPod()
    return OtherPod()


class FilterOutcome(msgspec.Struct, frozen=True, kw_only=True):
    passed: list[str]
    failed: dict[str, str]


def filter_nodes(pod: Pod, nodes: Sequence[Node], usage: ShareUsage) -> FilterOutcome:
    kind = classify(pod)
    passed: list[str] = []
    failed: dict[str, str] = {}
    for node in nodes:
        reason = why_not(kind, node, usage)
        if reason is None:
            passed.append(node.name)
        else:
            failed[node.name] = reason
    return FilterOutcome(passed=passed, failed=failed)


def why_not(kind: PodKind, node: Node, usage: ShareUsage) -> str | None:
    """Why the pod may not go to ``node`` (None: it may)."""
    state = read_share_state(node)
    match kind:
        case OtherPod():
            return None
        case ExclusiveGpuPod():
            sharing = state.in_force or (
                state.label if state.label in ("share-pool", "static") else None
            )
            if sharing is None:
                return None
            return (
                f"GPU sharing ({sharing}) is on for this node: pods requesting whole GPUs "
                f"({EXCLUSIVE_GPU_RESOURCE}) are kept off it"
            )
        case InvalidGpuSharePod():
            return (
                f"not a valid GPU-sharing pod ({kind.rejection.reason}): {kind.rejection.message}"
            )
        case GpuSharePod():
            policy = kind.spec.policy
            if state.in_force is None:
                return (
                    "GPU sharing is not enabled on this node (condition GPUSharePolicy is not True)"
                )
            if state.in_force != policy:
                return f"the node's GPU share policy is {state.in_force}, the pod's is {policy}"
            if state.label != policy:
                return f"the node is being switched from {policy} to {state.label or 'none'}"
            if not state.valid:
                return (
                    f"the node's GPU share policy configuration is invalid "
                    f"({state.invalid_reason}): {state.invalid_message}"
                )
            return _no_room(node, usage(node.name), kind.spec.requests)


def _no_room(node: Node, used: Share, wanted: Share) -> str | None:
    for resource, used_amount, wanted_amount in (
        (CORE_RESOURCE, used.core, wanted.core),
        (MEMORY_RESOURCE, used.memory, wanted.memory),
    ):
        allocatable = _allocatable(node, resource)
        free = max(0, allocatable - used_amount)
        if wanted_amount > free:
            return (
                f"insufficient {resource}: the pod requests {wanted_amount}, "
                f"{free} of {allocatable} are free"
            )
    return None


def _allocatable(node: Node, resource: str) -> int:
    value = node.status.allocatable.get(resource)
    if value is None:
        return 0
    try:
        return int(parse_quantity(str(value)))
    except ValueError:
        return 0


def prioritize(pod: Pod, nodes: Sequence[Node], usage: ShareUsage) -> list[HostPriority]:
    kind = classify(pod)
    scores: list[HostPriority] = []
    for node in nodes:
        score = 0
        if isinstance(kind, GpuSharePod) and why_not(kind, node, usage) is None:
            score = best_fit_score(node, usage(node.name), kind.spec.requests)
        scores.append(HostPriority(host=node.name, score=score))
    return scores


def best_fit_score(node: Node, used: Share, wanted: Share) -> int:
    """0..10: how full the node's share resources are once the pod is placed there."""
    fullness = Fraction(0)
    for resource, used_amount, wanted_amount in (
        (CORE_RESOURCE, used.core, wanted.core),
        (MEMORY_RESOURCE, used.memory, wanted.memory),
    ):
        allocatable = _allocatable(node, resource)
        if allocatable <= 0:
            return 0
        fullness += Fraction(min(allocatable, used_amount + wanted_amount), allocatable)
    return int(fullness / 2 * MAX_EXTENDER_PRIORITY)
