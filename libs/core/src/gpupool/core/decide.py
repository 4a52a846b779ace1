"""decide(state, command, now) -> events. Pure: time is an argument; the state is never mutated.

Which service sends which command (the deciders never execute anything):

* policy: ConfigureNode, RegisterPod, RemovePod, ReconcilePods (after each first list)
* node-executor: ReportInventory, RequestGpu, ReportRelease
* admission-queue: Schedule (after every event on a node)
* preemption: PlanPreemption (after every event on a node, and at the
  times ``next_preemption_check`` names)
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from functools import lru_cache
from itertools import repeat
from operator import itemgetter

import msgspec

from gpupool.core.evolve import evolve
from gpupool.core.fragmentation import Workload
from gpupool.core.input_bounds import refuse_node_config, refuse_pod_manifest
from gpupool.core.placement import (
    add,
    choose_gpu,
    choose_gpu_in_order,
    reservation_gpu,
    static_usage,
)
from gpupool.core.preemption import plan_preemption
from gpupool.core.state import GPU_PERCENT, PodState, State
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
    Share,
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


class PresentPod(msgspec.Struct, frozen=True, kw_only=True):
    """A GPU-sharing pod the cluster has on a node, with its UID ("" if unknown)."""

    pod: PodRef
    uid: str = ""


class ReconcilePods(msgspec.Struct, frozen=True, kw_only=True):
    """After a (re)start's first list: the node's GPU-sharing pods the cluster has.

    Pods registered in the log that the cluster no longer has (deleted while the
    policy service was away), or has under another UID (deleted and recreated under
    the same name), are removed; a recreated pod then registers as a new one.
    """

    node: str
    present: tuple[PresentPod, ...]


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
    | ReconcilePods
    | RequestGpu
    | ReportRelease
    | Schedule
    | PlanPreemption
)


def decide(state: State, command: Command, now: datetime) -> list[Event]:
    if type(command) is Schedule:  # the deciders' most frequent commands first, without the match
        return schedule(state, command.node, now)
    if type(command) is PlanPreemption:
        return plan_node_preemption(state, command.node, now)
    if type(command) is RequestGpu:
        return _request_gpu(state, command)
    if type(command) is ReportRelease:
        return _report_release(state, command)
    if type(command) is RegisterPod:  # a name the log cannot hold is refused first
        return refuse_pod_manifest(command.manifest) or _register_pod(state, command.manifest)
    match command:
        case ConfigureNode():  # a name the log cannot hold is refused first (input_bounds)
            return refuse_node_config(command.node, command.gpu_count) or _configure_node(
                state, command
            )
        case ReportInventory():
            return _report_inventory(state, command)
        case RegisterPod():
            return refuse_pod_manifest(command.manifest) or _register_pod(state, command.manifest)
        case RemovePod():
            return _remove_pod(state, command)
        case ReconcilePods():
            return _reconcile_pods(state, command)
        case RequestGpu():
            return _request_gpu(state, command)
        case ReportRelease():
            return _report_release(state, command)
        case Schedule():
            return schedule(state, command.node, now)
        case PlanPreemption():
            return plan_node_preemption(state, command.node, now)


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
    """Record the inventory; in the same decision, release what held a vanished GPU and bind
    the static pods that wait for one (a static pod registered before any inventory)."""
    node = state.nodes.get(command.node)
    if node is not None and node.gpus == command.gpus and node.inventory_source == command.source:
        return []
    events: list[Event] = [
        GpuInventoryReported(node=command.node, gpus=command.gpus, source=command.source)
    ]
    present = {gpu.index: gpu.uuid for gpu in command.gpus}
    for pod in state.pods_on(command.node):
        if pod.gpu_index is None:
            continue
        if present.get(pod.gpu_index) == pod.gpu_uuid or (
            pod.gpu_uuid == "" and pod.gpu_index in present
        ):
            continue
        events.append(
            Released(
                pod=pod.ref,
                node=pod.node,
                reason="gpu-vanished",
                gpu_index=pod.gpu_index,
                gpu_uuid=pod.gpu_uuid,
            )
        )
    if node is None or node.policy != "static" or not command.gpus:
        return events  # what bind_waiting_static_pods finds on the state after, without copying it
    after = apply(state.copy(), events, _NO_TIME)
    return events + bind_waiting_static_pods(after, command.node)


_NO_TIME = datetime.min.replace(tzinfo=UTC)
"""The time folded into a planning copy (the decided events get theirs when appended)."""


def bind_waiting_static_pods(state: State, node_name: str) -> list[Event]:
    """Assigned for each registered static pod without a GPU that now fits one (in order)."""
    node = state.nodes.get(node_name)
    if node is None or node.policy != "static" or not node.gpus:
        return []
    pods = state.pods_on(node_name)
    uuids = {gpu.index: gpu.uuid for gpu in node.gpus}
    usage = {index: used for index, used in static_usage(node, pods).items() if index in uuids}
    events: list[Event] = []
    for pod in pods:
        if pod.policy != "static" or pod.gpu_index is not None or pod.removed:
            continue
        gpu = choose_gpu(usage, pod.requests)
        if gpu is None:
            events.append(
                PodRejected(
                    pod=pod.ref,
                    node=node_name,
                    reason="NoStaticGpuFits",
                    message=f"no GPU of {node_name!r} has {pod.requests.core}% compute and "
                    f"{pod.requests.memory}% memory left for a static pod; it stays registered "
                    "and is bound when the inventory changes",
                )
            )
            continue
        events.append(Assigned(pod=pod.ref, node=node_name, gpu_index=gpu, gpu_uuid=uuids[gpu]))
        usage[gpu] = add(usage[gpu], pod.requests)
    return events


# --------------------------------------------------------------------------- pods


def _register_pod(state: State, manifest: PodManifest) -> list[Event]:
    ref = PodRef(namespace=manifest.namespace, name=manifest.name)

    def reject(reason: str, message: str) -> list[Event]:
        return [PodRejected(pod=ref, node=manifest.node, reason=reason, message=message)]

    existing = state.pods.get(ref)
    if existing is not None:
        if existing.uid == manifest.uid and existing.node == manifest.node:
            return []
        if existing.removed:
            return reject(
                "PreviousPodReleasing",
                f"an earlier pod {ref} (uid {existing.uid or 'unknown'}) was deleted and its "
                f"processes on {existing.node} are still being ended; register again once it "
                "is released",
            )
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
    total = node.requested  # allocated_requests of the pods registered there, kept by evolve
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
    if spec.policy == "share-pool" or not node.gpus:
        # a static pod bound before the node's inventory arrives waits for it, registered
        return [registered]
    present = {gpu.index for gpu in node.gpus}
    pods = state.pods_on(manifest.node)
    usage = {index: used for index, used in static_usage(node, pods).items() if index in present}
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
    if pod is None or pod.removed:
        return []
    return [PodRemoved(pod=command.pod, node=pod.node)]


def _reconcile_pods(state: State, command: ReconcilePods) -> list[Event]:
    present = {pod.pod: pod.uid for pod in command.present}
    events: list[Event] = []
    for pod in state.pods_on(command.node):
        if pod.removed:
            continue
        uid = present.get(pod.ref)
        if uid is None or (uid and pod.uid and uid != pod.uid):
            events.append(PodRemoved(pod=pod.ref, node=pod.node))
    return events


def _rejected(command: RequestGpu | ReportRelease, *, reason: str, message: str) -> list[Event]:
    return [PodRejected(pod=command.pod, node=command.node, reason=reason, message=message)]


def _request_gpu(state: State, command: RequestGpu) -> list[Event]:
    pod = state.pods.get(command.pod)
    if pod is None:
        return _rejected(
            command,
            reason="UnknownPod",
            message=f"pod {command.pod} is not registered for GPU sharing",
        )
    if pod.node != command.node:
        return _rejected(
            command,
            reason="WrongNode",
            message=f"pod {command.pod} is registered on {pod.node}, not {command.node}",
        )
    if pod.removed:
        return _rejected(
            command,
            reason="PodDeleted",
            message=f"pod {command.pod} was deleted; its processes are being ended",
        )
    if pod.policy == "static":
        if pod.phase != "dormant":
            return []
        if pod.gpu_index is None:
            return _rejected(
                command,
                reason="NoStaticGpu",
                message=f"static pod {command.pod} has no GPU bound yet (the node's inventory has not "
                "arrived, or no GPU had room); it is bound when one does",
            )
        # a static pod runs again on the GPU it stays bound to
        return [
            Assigned(pod=command.pod, node=pod.node, gpu_index=pod.gpu_index, gpu_uuid=pod.gpu_uuid)
        ]
    node = state.nodes.get(pod.node)
    if node is None or node.policy is None:  # not node.enabled
        return _rejected(
            command,
            reason="NodeNotEnabled",
            message=f"node {pod.node!r} does not have GPU sharing enabled",
        )
    if pod.phase != "dormant":
        return _rejected(
            command, reason="NotDormant", message=f"pod {command.pod} is already {pod.phase}"
        )
    if not node.gpus:
        return _rejected(
            command, reason="NoGpus", message=f"node {pod.node!r} has reported no GPUs yet"
        )
    return [PodReady(pod=command.pod, node=pod.node)]


def _report_release(state: State, command: ReportRelease) -> list[Event]:
    pod = state.pods.get(command.pod)
    if pod is None:
        return _rejected(
            command,
            reason="UnknownPod",
            message=f"pod {command.pod} is not registered for GPU sharing",
        )
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
    return _rejected(
        command,
        reason="NotRunning",
        message=f"pod {command.pod} is {pod.phase}: it holds no GPU to release",
    )


# --------------------------------------------------------------------------- the queue


def schedule(state: State, node_name: str, now: datetime) -> list[Event]:
    """Serve the node's ready queue in order (strict head-of-line; backfill if the node opts in).

    It reads the indexes ``evolve`` keeps (``NodeState.queue``, ``usage``, ``shares``), so
    with the head blocked and no backfill it costs O(GPUs), whatever the queue's length.
    """
    node = state.nodes.get(node_name)
    if node is None or node.policy != "share-pool" or not node.gpus or not node.queue:
        return []
    pods = state.pods
    queue = node.queue
    head = pods[queue[0][4]]
    gpus = node.gpus
    inventory = _INVENTORIES.get(id(gpus))  # _inventory(gpus), its lookup spelt out
    if inventory is None or inventory.gpus is not gpus:
        inventory = _inventory(gpus)
    # only GPUs of the inventory can be chosen (a slot on a vanished one is being released)
    values = inventory.usage_of(node.usage)
    backfill = node.qos.backfill
    if not backfill:
        limits = head.limits  # _fits_some(values, limits), spelt out
        core_left = GPU_PERCENT - limits.core
        memory_left = GPU_PERCENT - limits.memory
        for used in values:
            if used.core <= core_left and used.memory <= memory_left:
                break
        else:
            return []  # the head is blocked and nobody may pass it: O(GPUs), nothing allocated
    uuids, order, positions = inventory.uuids, inventory.order, inventory.positions
    shares = tuple(node.shares.items())
    events: list[Event] = []
    position = 0
    while position < len(queue):
        if position:
            head = pods[queue[position][4]]
            if not _fits_some(values, head.limits):
                break  # what choose_gpu would find, without building its arguments
        gpu = _chosen_gpu(order, values, head.limits, None, shares)
        if gpu is None:
            break
        events.append(Assigned(pod=head.ref, node=node_name, gpu_index=gpu, gpu_uuid=uuids[gpu]))
        at = positions[gpu]
        values = (*values[:at], add(values[at], head.limits), *values[at + 1 :])
        position += 1
    if position < len(queue) and backfill:
        usage = dict(zip(order, values, strict=True))
        head = pods[queue[position][4]]
        reserved = reservation_gpu(usage, head, state.pods_on(node_name))
        for key in queue[position + 1 :]:
            pod = pods[key[4]]
            gpu = _chosen_gpu(order, tuple(usage.values()), pod.limits, reserved, shares)
            if gpu is None:
                continue
            events.append(Assigned(pod=pod.ref, node=node_name, gpu_index=gpu, gpu_uuid=uuids[gpu]))
            usage[gpu] = add(usage[gpu], pod.limits)
    return events


_NO_SHARE = Share(core=0, memory=0)


class _Inventory:
    """A node's inventory as ``schedule`` reads it: each GPU's UUID by index, the indexes in
    order, each index's position in that order, and the usage of those GPUs in that order."""

    __slots__ = ("_values", "gpus", "order", "positions", "uuids")

    def __init__(self, gpus: tuple[GpuInfo, ...]) -> None:
        self.gpus = gpus
        self.uuids = {gpu.index: gpu.uuid for gpu in gpus}
        self.order = tuple(sorted(self.uuids))
        self.positions = {index: at for at, index in enumerate(self.order)}
        self._values = itemgetter(*self.order)

    def usage_of(self, usage: dict[int, Share]) -> tuple[Share, ...]:
        """The usage of the inventory's GPUs, in order (a GPU without an entry: nothing)."""
        order = self.order
        if len(usage) >= len(order):
            try:
                # every GPU of the inventory has pods running (a full node, as when the head
                # is blocked): one lookup of them all
                found = self._values(usage)
            except KeyError:
                pass
            else:
                return found if len(order) > 1 else (found,)
        return tuple(map(usage.get, order, repeat(_NO_SHARE)))


_INVENTORIES: dict[int, _Inventory] = {}


def _inventory(gpus: tuple[GpuInfo, ...]) -> _Inventory:
    """``_Inventory`` of a node's GPUs, memoised on the inventory tuple itself (a node keeps the
    one its last GpuInventoryReported brought): a pure function of it, never mutated."""
    found = _INVENTORIES.get(id(gpus))
    if found is not None and found.gpus is gpus:
        return found
    if len(_INVENTORIES) >= 4096:
        _INVENTORIES.clear()
    found = _INVENTORIES[id(gpus)] = _Inventory(gpus)  # the tuple held: its id is not reused
    return found


NodeShares = tuple[tuple[Share, int], ...]
"""A node's workload as ``NodeState.shares`` holds it: (limits share, pods with it)."""


@lru_cache(maxsize=1024)
def _node_workload(shares: NodeShares) -> Workload:
    return Workload.of_shares(shares)  # Workload.of({Task(gpus=1, share=s): n, ...})


@lru_cache(maxsize=4096)
def _chosen_gpu(
    order: tuple[int, ...],
    used: tuple[Share, ...],
    want: Share,
    exclude: int | None,
    shares: NodeShares,
) -> int | None:
    """``choose_gpu`` with the node's workload, memoised: a pure function of its arguments
    (the usage of the GPUs ``order`` names, ``used`` in that order), and a node's usage takes
    the same few shapes again and again (the fragmentation measure is most of a decision
    that assigns)."""
    return choose_gpu_in_order(order, used, want, exclude, _node_workload(shares))


def _fits_some(usage: Iterable[Share], want: Share) -> bool:
    """Whether ``want`` fits (``fits``) on any GPU whose usage is in ``usage``."""
    core_left = GPU_PERCENT - want.core
    memory_left = GPU_PERCENT - want.memory
    for used in usage:  # noqa: SIM110 (a plain loop: no generator to start each time)
        if used.core <= core_left and used.memory <= memory_left:
            return True
    return False


def plan_node_preemption(state: State, node_name: str, now: datetime) -> list[Event]:
    """``decide(state, PlanPreemption(node=node_name), now)``."""
    node = state.nodes.get(node_name)
    if node is None or not node.qos.preempt_enabled or not node.queue:
        return []  # what plan_preemption would find first, without building the usage
    usage = {gpu.index: node.usage.get(gpu.index, _NO_SHARE) for gpu in node.gpus}
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
