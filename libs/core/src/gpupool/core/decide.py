"""decide(state, command, now) -> events. Pure: time is an argument; the state is never mutated.

Which service sends which command (the deciders never execute anything):

* policy: ConfigureNode, RegisterPod, RemovePod
* node-executor: ReportInventory, RequestGpu, ReportRelease
* admission-queue: Schedule (after every event on a node)
* preemption: PlanPreemption (after every event on a node, and at the
  times ``next_preemption_check`` names)
"""

from __future__ import annotations

from datetime import datetime

import msgspec

from gpupool.core.evolve import evolve
from gpupool.core.placement import (
    add,
    allocated_requests,
    choose_gpu,
    gpu_usage,
    node_workload,
    ready_queue,
    reservation_gpu,
    static_usage,
)
from gpupool.core.preemption import plan_preemption
from gpupool.core.state import PodState, State
from gpupool.core.validation import (
    PodManifest,
    Rejection,
    parse_qos_annotation,
    validate_node_policy,
    validate_pod,
)
from gpupool.events import (
    Assigned,
    Envelope,
    Event,
    GpuInfo,
    GpuInventoryReported,
    InventorySource,
    NodeConfigured,
    NodeDisabled,
    NodeRejected,
    PodReady,
    PodRef,
    PodRegistered,
    PodRejected,
    PodRemoved,
    Preempted,
    Released,
    ReleaseReason,
)


class ConfigureNode(msgspec.Struct, frozen=True, kw_only=True):
    """The node's policy label and QoS annotation as found (raw), with what blocks enabling."""

    node: str
    policy_label: str | None
    qos_annotation: str | None = None
    gpu_count: int = 0
    exclusive_gpu_pods: tuple[str, ...] = ()
    """Pods on the node that request whole GPUs (``nvidia.com/gpu``): they block enabling."""


class ReportInventory(msgspec.Struct, frozen=True, kw_only=True):
    node: str
    gpus: tuple[GpuInfo, ...]
    source: InventorySource


class RegisterPod(msgspec.Struct, frozen=True, kw_only=True):
    manifest: PodManifest


class RemovePod(msgspec.Struct, frozen=True, kw_only=True):
    pod: PodRef
    node: str


class RequestGpu(msgspec.Struct, frozen=True, kw_only=True):
    pod: PodRef
    node: str


class ReportRelease(msgspec.Struct, frozen=True, kw_only=True):
    pod: PodRef
    node: str
    reason: ReleaseReason
    exit_code: int | None = None


class Schedule(msgspec.Struct, frozen=True, kw_only=True):
    node: str


class PlanPreemption(msgspec.Struct, frozen=True, kw_only=True):
    node: str


Command = (
    ConfigureNode
    | ReportInventory
    | RegisterPod
    | RemovePod
    | RequestGpu
    | ReportRelease
    | Schedule
    | PlanPreemption
)


def decide(state: State, command: Command, now: datetime) -> list[Event]:
    match command:
        case ConfigureNode():
            return _configure_node(state, command)
        case ReportInventory():
            return _report_inventory(state, command)
        case RegisterPod():
            return _register_pod(state, command.manifest)
        case RemovePod():
            return _remove_pod(state, command)
        case RequestGpu():
            return _request_gpu(state, command)
        case ReportRelease():
            return _report_release(state, command)
        case Schedule():
            return schedule(state, command.node, now)
        case PlanPreemption():
            return _plan_preemption(state, command.node, now)


# --------------------------------------------------------------------------- nodes


def _configure_node(state: State, command: ConfigureNode) -> list[Event]:
    name = command.node
    policy = validate_node_policy(command.policy_label)
    if isinstance(policy, Rejection):
        return [NodeRejected(node=name, reason=policy.reason, message=policy.message)]
    node = state.nodes.get(name)
    registered = state.pods_on(name)
    if policy is None:
        if node is None or (not node.enabled and node.rejection is None):
            return []
        if registered:
            return [
                NodeRejected(
                    node=name,
                    reason="SharePodsPresent",
                    message=f"cannot disable GPU sharing on {name}: delete its "
                    f"{len(registered)} GPU-sharing pod(s) first ({_names(registered)})",
                )
            ]
        return [NodeDisabled(node=name)]
    qos = parse_qos_annotation(command.qos_annotation)
    if isinstance(qos, Rejection):
        return [NodeRejected(node=name, reason=qos.reason, message=qos.message)]
    if command.exclusive_gpu_pods and (node is None or not node.enabled):
        return [
            NodeRejected(
                node=name,
                reason="ExclusiveGpuPodsPresent",
                message=f"cannot enable {policy} on {name}: pods requesting whole GPUs "
                f"(nvidia.com/gpu) still run there: {', '.join(command.exclusive_gpu_pods)}",
            )
        ]
    if node is not None and node.enabled and node.policy != policy and registered:
        return [
            NodeRejected(
                node=name,
                reason="SharePodsPresent",
                message=f"cannot change {name} from {node.policy} to {policy}: delete its "
                f"GPU-sharing pods first ({_names(registered)})",
            )
        ]
    if (
        node is not None
        and node.enabled
        and node.policy == policy
        and node.qos == qos
        and node.gpu_count == command.gpu_count
        and node.rejection is None
    ):
        return []
    return [NodeConfigured(node=name, policy=policy, qos=qos, gpu_count=command.gpu_count)]


def _names(pods: list[PodState]) -> str:
    refs = [str(pod.ref) for pod in pods]
    shown = ", ".join(refs[:5])
    return shown + (f" and {len(refs) - 5} more" if len(refs) > 5 else "")


def _report_inventory(state: State, command: ReportInventory) -> list[Event]:
    node = state.nodes.get(command.node)
    if node is not None and node.gpus == command.gpus and node.inventory_source == command.source:
        return []
    return [GpuInventoryReported(node=command.node, gpus=command.gpus, source=command.source)]


# --------------------------------------------------------------------------- pods


def _register_pod(state: State, manifest: PodManifest) -> list[Event]:
    ref = PodRef(namespace=manifest.namespace, name=manifest.name)

    def reject(reason: str, message: str) -> list[Event]:
        return [PodRejected(pod=ref, node=manifest.node, reason=reason, message=message)]

    existing = state.pods.get(ref)
    if existing is not None:
        if existing.uid == manifest.uid and existing.node == manifest.node:
            return []
        return reject("AlreadyRegistered", f"pod {ref} is already registered on {existing.node}")
    spec = validate_pod(manifest)
    if isinstance(spec, Rejection):
        return reject(spec.reason, spec.message)
    node = state.nodes.get(manifest.node)
    if node is None or not node.enabled:
        return reject(
            "NodeNotEnabled",
            f"node {manifest.node!r} does not have GPU sharing enabled "
            "(label alibabacloud.com/gpu-share-policy)",
        )
    if node.policy != spec.policy:
        return reject(
            "PolicyMismatch",
            f"pod policy {spec.policy!r} does not match node {manifest.node!r} policy {node.policy!r}",
        )
    pods = state.pods_on(manifest.node)
    total = allocated_requests(pods)
    allocatable = node.allocatable_percent
    if (
        total.core + spec.requests.core > allocatable
        or total.memory + spec.requests.memory > allocatable
    ):
        return reject(
            "InsufficientAllocatable",
            f"node {manifest.node!r} has {allocatable} allocatable of each GPU-share resource; "
            f"{total.core} core / {total.memory} memory already requested, this pod asks "
            f"{spec.requests.core} / {spec.requests.memory}",
        )
    registered = PodRegistered(
        pod=ref,
        node=manifest.node,
        policy=spec.policy,
        requests=spec.requests,
        limits=spec.limits,
        priority=manifest.priority,
        uid=manifest.uid,
    )
    if spec.policy == "share-pool":
        return [registered]
    usage = static_usage(node, pods)
    gpu = choose_gpu(usage, spec.requests)
    if gpu is None:
        return reject(
            "NoStaticGpuFits",
            f"no GPU of {manifest.node!r} has {spec.requests.core}% compute and "
            f"{spec.requests.memory}% memory left for a static pod",
        )
    uuid = next(g.uuid for g in node.gpus if g.index == gpu)
    return [registered, Assigned(pod=ref, node=manifest.node, gpu_index=gpu, gpu_uuid=uuid)]


def _remove_pod(state: State, command: RemovePod) -> list[Event]:
    pod = state.pods.get(command.pod)
    if pod is None:
        return []
    return [PodRemoved(pod=command.pod, node=pod.node)]


def _request_gpu(state: State, command: RequestGpu) -> list[Event]:
    pod = state.pods.get(command.pod)

    def reject(reason: str, message: str) -> list[Event]:
        return [PodRejected(pod=command.pod, node=command.node, reason=reason, message=message)]

    if pod is None:
        return reject("UnknownPod", f"pod {command.pod} is not registered for GPU sharing")
    if pod.node != command.node:
        return reject(
            "WrongNode", f"pod {command.pod} is registered on {pod.node}, not {command.node}"
        )
    if pod.policy == "static":
        return []
    node = state.nodes.get(pod.node)
    if node is None or not node.enabled:
        return reject("NodeNotEnabled", f"node {pod.node!r} does not have GPU sharing enabled")
    if pod.phase != "dormant":
        return reject("NotDormant", f"pod {command.pod} is already {pod.phase}")
    if not node.gpus:
        return reject("NoGpus", f"node {pod.node!r} has reported no GPUs yet")
    return [PodReady(pod=command.pod, node=pod.node)]


def _report_release(state: State, command: ReportRelease) -> list[Event]:
    pod = state.pods.get(command.pod)

    def reject(reason: str, message: str) -> list[Event]:
        return [PodRejected(pod=command.pod, node=command.node, reason=reason, message=message)]

    if pod is None:
        return reject("UnknownPod", f"pod {command.pod} is not registered for GPU sharing")
    if pod.policy == "static":
        return []
    if pod.phase == "running":
        return [
            Released(
                pod=command.pod,
                node=pod.node,
                reason=command.reason,
                gpu_index=pod.gpu_index,
                gpu_uuid=pod.gpu_uuid,
                exit_code=command.exit_code,
            )
        ]
    if pod.phase == "ready" and command.reason == "cancelled":
        return [Released(pod=command.pod, node=pod.node, reason="cancelled")]
    return reject("NotRunning", f"pod {command.pod} is {pod.phase}: it holds no GPU to release")


# --------------------------------------------------------------------------- the queue


def schedule(state: State, node_name: str, now: datetime) -> list[Event]:
    """Serve the node's ready queue in order (strict head-of-line; backfill if the node opts in)."""
    node = state.nodes.get(node_name)
    if node is None or node.policy != "share-pool" or not node.gpus:
        return []
    pods = state.pods_on(node_name)
    usage = gpu_usage(node, pods)
    workload = node_workload(pods)
    uuids = {gpu.index: gpu.uuid for gpu in node.gpus}
    events: list[Event] = []
    queue = ready_queue(state, node_name)
    position = 0
    while position < len(queue):
        head = queue[position]
        gpu = choose_gpu(usage, head.limits, workload=workload)
        if gpu is None:
            break
        events.append(Assigned(pod=head.ref, node=node_name, gpu_index=gpu, gpu_uuid=uuids[gpu]))
        usage[gpu] = add(usage[gpu], head.limits)
        position += 1
    if position < len(queue) and node.qos.backfill:
        head = queue[position]
        reserved = reservation_gpu(usage, head, pods)
        for pod in queue[position + 1 :]:
            gpu = choose_gpu(usage, pod.limits, exclude=reserved, workload=workload)
            if gpu is None:
                continue
            events.append(Assigned(pod=pod.ref, node=node_name, gpu_index=gpu, gpu_uuid=uuids[gpu]))
            usage[gpu] = add(usage[gpu], pod.limits)
    return events


def _plan_preemption(state: State, node_name: str, now: datetime) -> list[Event]:
    node = state.nodes.get(node_name)
    if node is None:
        return []
    usage = gpu_usage(node, state.pods_on(node_name))
    plan = plan_preemption(state, node_name, usage, now)
    if plan is None:
        return []
    return [
        Preempted(
            victim=victim.pod.ref,
            preemptor=plan.head.ref,
            node=node_name,
            gpu_index=plan.gpu_index,
            gpu_uuid=plan.gpu_uuid,
            reason=victim.reason,
        )
        for victim in plan.victims
    ]


def apply(state: State, events: list[Event], now: datetime) -> State:
    """Fold decided events into ``state`` (used by simulations and tests; services fold the log)."""
    for index, event in enumerate(events):
        evolve(state, Envelope(id=f"apply-{index}", time=now, event=event))
    return state
