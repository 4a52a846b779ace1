"""Which nodes a pod may go to, and which it should prefer. Pure: nodes, pods and usage in, verdicts out.

Filter (docs/behaviour.md, ours):

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

Prioritize: least fragmentation (docs/placement.md). Every pod the scheduler asks
about (GPU-sharing, whole-GPU, CPU-only) scores each node it may go to by the
fragmentation its placement adds there, for the workload the cluster has seen
(``gpupool.core.fragmentation``), with the node's CPU and memory, plus the change of
the free GPU its CPU and memory left could not serve (``stranded``): nodes where it
fits a GPU by limits now first, then the lowest gradient, then the fullest node.
The cheapest get 10, the others 2..9 by rank; nodes where it would wait 1 or 0.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import TypeVar

import msgspec

from gpupool.core import PodSpec, Rejection, validate_pod
from gpupool.core.fragmentation import (
    NodeFree,
    Task,
    Workload,
    fragmentation,
    place,
    stranded,
)
from gpupool.core.placement import GpuUsage, add, choose_gpu
from gpupool.core.state import GPU_PERCENT
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


def prioritize(
    pod: Pod,
    nodes: Sequence[Node],
    usage: ShareUsage,
    models: NodeModels,
    workload: Workload,
    *,
    cost: Callable[[Node, Task], Cost] | None = None,
) -> list[HostPriority]:
    """Score every node the pod may go to by the fragmentation its placement adds there
    (``placement_cost`` over the cluster's ``workload``, ``scores_by_cost``); 0 where the
    filter keeps it off. Every pod is scored: GPU-sharing, whole-GPU and CPU-only alike.
    ``cost``: the same ``placement_cost`` remembered by the caller (the extender's cache)."""
    kind = classify(pod)
    task = pod_task(pod, kind)
    costs: dict[str, Cost] = {}
    if task is not None:
        for node in nodes:
            if why_not(kind, node, usage) is None:
                if cost is not None:
                    costs[node.name] = cost(node, task)
                else:
                    costs[node.name] = placement_cost(models(node), task, workload)[0]
    scores = scores_by_cost(costs)
    return [HostPriority(host=node.name, score=scores.get(node.name, 0)) for node in nodes]


def pod_task(pod: Pod, kind: PodKind | None = None) -> Task | None:
    """The pod as the fragmentation measure sees it (None: not a pod that can be placed)."""
    kind = classify(pod) if kind is None else kind
    cpu = memory = 0
    for container in pod.spec.containers:
        cpu += _amount(container.resources.requests.get("cpu"), 1000)
        memory += _amount(container.resources.requests.get("memory"), Fraction(1, 1 << 20))
    match kind:
        case GpuSharePod():
            return Task(cpu_milli=cpu, memory_mib=memory, gpus=1, share=kind.spec.limits)
        case ExclusiveGpuPod():
            whole = sum(
                _amount(c.resources.limits.get(EXCLUSIVE_GPU_RESOURCE), 1)
                or _amount(c.resources.requests.get(EXCLUSIVE_GPU_RESOURCE), 1)
                for c in pod.spec.containers
            )
            return Task(cpu_milli=cpu, memory_mib=memory, gpus=max(1, whole), share=WHOLE_SHARE)
        case OtherPod():
            return Task(cpu_milli=cpu, memory_mib=memory, gpus=0, share=NO_SHARE)
        case InvalidGpuSharePod():
            return None


WHOLE_SHARE = Share(core=GPU_PERCENT, memory=GPU_PERCENT)
NO_SHARE = Share(core=0, memory=0)


def _amount(value: object, scale: int | Fraction) -> int:
    """A quantity times ``scale``, rounded up (0 if absent or unreadable)."""
    if value is None:
        return 0
    try:
        scaled = Fraction(parse_quantity(str(value))) * scale
    except ValueError:
        return 0
    return -(-scaled.numerator // scaled.denominator)


PodView = tuple[PodKind, Task | None]
"""A pod as the node model reads it: ``classify`` and ``pod_task`` (callers may remember it)."""


def pod_view(pod: Pod) -> PodView:
    kind = classify(pod)
    return kind, pod_task(pod, kind)


def node_model(
    node: Node, bound: Sequence[Pod], view: Callable[[Pod], PodView] = pod_view
) -> NodeModel:
    """The extender's model of ``node`` with ``bound`` (the live pods bound to it, in the
    order they were bound).

    CPU and memory: the node's allocatable minus the pods' requests. GPUs: on a
    share-pool node, share allocatable / 100 GPUs, and the GPU-sharing pods are placed
    in order by the core's own ``choose_gpu`` with the node's workload (``node_workload``
    would give the same: the limits of the pods there), by their limits: a pod no GPU
    takes is counted as waiting, and so is every later one (the queue's order is strict).
    On another node, ``nvidia.com/gpu`` allocatable GPUs, the whole-GPU pods taking the
    lowest-indexed ones.
    """
    cpu = _amount(node.status.allocatable.get("cpu"), 1000)
    memory = _amount(node.status.allocatable.get("memory"), Fraction(1, 1 << 20))
    sharing = read_share_state(node).in_force is not None
    if sharing:
        count = _allocatable(node, CORE_RESOURCE) // GPU_PERCENT
    else:
        count = _amount(node.status.allocatable.get(EXCLUSIVE_GPU_RESOURCE), 1)
    usage: GpuUsage = {index: NO_SHARE for index in range(count)}
    shares: list[Share] = []
    whole = 0
    for pod in bound:
        kind, task = view(pod)
        if task is None:
            continue
        cpu -= task.cpu_milli
        memory -= task.memory_mib
        if isinstance(kind, GpuSharePod):
            shares.append(task.share)
        elif isinstance(kind, ExclusiveGpuPod):
            whole += task.gpus
    seen = Workload.of(Task(share=share) for share in shares)
    waiting = 0
    for share in shares:
        gpu = None if waiting else choose_gpu(usage, share, workload=seen)
        if gpu is None:
            waiting += 1
        else:
            usage[gpu] = add(usage[gpu], share)
    for index in range(min(whole, count)):
        usage[index] = WHOLE_SHARE
    free = NodeFree(
        cpu_milli=max(0, cpu),
        memory_mib=max(0, memory),
        gpus=tuple(
            Share(core=GPU_PERCENT - usage[i].core, memory=GPU_PERCENT - usage[i].memory)
            for i in range(count)
        ),
    )
    return NodeModel(free=free, usage=usage, waiting=waiting, seen=seen)


# --------------------------------------------------------------------------- fragmentation


class NodeModel(msgspec.Struct, frozen=True, kw_only=True):
    """The extender's model of a node, for scoring (docs/placement.md).

    ``free``: CPU and memory left by requests, and each GPU's free compute and memory by
    the limits of the pods the model placed there. ``usage``: those limits by GPU index
    (the same GPUs as ``free.gpus``, in index order). ``waiting``: GPU-sharing pods bound
    here that the model could not place (they wait in the node's ready queue; its order
    is strict, so a new pod would wait behind them). ``seen``: the GPU shares of the
    pods bound here, the workload of the node's own GPU choice.
    """

    free: NodeFree
    usage: GpuUsage
    waiting: int = 0
    seen: Workload = Workload()


NodeModels = Callable[[Node], NodeModel]
"""The extender's model of a node (``node_model`` over the pods bound there), by node."""


Cost = tuple[int, float, float]
"""Lower is better: (tier, fragmentation gradient plus the change of the stranded GPU,
share of the node's GPU compute left free afterwards). Tier 0: the pod fits a GPU by
limits now; tier 1: it would wait behind pods already waiting there (the queue is blocked
anyway); tier 2: it would be the first to wait."""

FITS_NOW, BEHIND_WAITING, FIRST_TO_WAIT = 0, 1, 2
NodeKey = TypeVar("NodeKey")


def node_gpu_choice(model: NodeModel, want: Share) -> int | None:
    """The GPU the node's core gives a pod asking ``want`` (None: it would wait)."""
    if model.waiting:
        return None
    return choose_gpu(model.usage, want, workload=model.seen or None)


def placement_cost(
    model: NodeModel,
    task: Task,
    workload: Workload,
    *,
    before: float | None = None,
    choose: Callable[[NodeModel, Share], int | None] = node_gpu_choice,
) -> tuple[Cost, tuple[int, ...]]:
    """What placing ``task`` on the node costs, and the GPUs the node's core would give it.

    The GPUs come from the core's ``choose_gpu`` with the node's own workload (one GPU)
    or are the lowest-indexed wholly free ones (several GPUs). The gradient is the change
    of the node's expected fragment over the cluster's ``workload``, CPU and memory
    included: a placement that starves a node of CPU makes its free GPUs fragments. To it
    is added the change of the node's ``stranded`` GPU (the free GPU compute its CPU and
    memory left could not serve at the workload's CPU and memory per GPU), in the same
    unit, unweighted: a pod that uses up CPU the node's free GPUs will need costs them.
    ``before``: the node's fragmentation now, if the caller knows it. ``choose``:
    ``node_gpu_choice``, or the same remembered by the caller.
    """
    indices = sorted(model.usage)
    if task.gpus == 1:
        gpu = choose(model, task.share)
        if gpu is None:
            return _waits(model), ()
        gpus: tuple[int, ...] = (gpu,)
    elif task.gpus > 1:
        empty = [i for i in indices if model.usage[i].core == 0 and model.usage[i].memory == 0]
        if len(empty) < task.gpus:
            return _waits(model), ()
        gpus = tuple(empty[: task.gpus])
    else:
        gpus = ()
    position = {index: at for at, index in enumerate(indices)}
    after = place(model.free, task, (position[g] for g in gpus))
    if before is None:
        before = fragmentation(model.free, workload)
    change = fragmentation(after, workload) - before
    change += stranded(after, workload) - stranded(model.free, workload)
    capacity = GPU_PERCENT * len(indices)
    left = after.free_compute / capacity if capacity else 0.0
    return (0, round(change, 6), round(left, 6)), gpus


def _waits(model: NodeModel) -> Cost:
    return (BEHIND_WAITING if model.waiting else FIRST_TO_WAIT, 0.0, 0.0)


def scores_by_cost(costs: Mapping[NodeKey, Cost]) -> dict[NodeKey, int]:
    """0..10 by rank: the cheapest nodes where the pod fits now 10, the others where it fits
    now 2..9 by rank among the distinct costs; where it would wait behind pods already
    waiting 1, where it would be the first to wait 0."""
    now = sorted({cost for cost in costs.values() if cost[0] == FITS_NOW})
    rank = {cost: at for at, cost in enumerate(now)}
    scores: dict[NodeKey, int] = {}
    for name, cost in costs.items():
        if cost[0] != FITS_NOW:
            scores[name] = 1 if cost[0] == BEHIND_WAITING else 0
        elif rank[cost] == 0:
            scores[name] = MAX_EXTENDER_PRIORITY
        else:
            scores[name] = max(2, MAX_EXTENDER_PRIORITY - 1 - (8 * rank[cost]) // len(now))
    return scores
