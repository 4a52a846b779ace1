"""evolve(state, envelope): fold one logged fact into the state. No decisions here."""

from __future__ import annotations

from bisect import bisect_left, insort
from datetime import datetime

from gpupool.core.state import GPU_PERCENT, NodeState, PodState, QueueKey, State
from gpupool.events import (
    Assigned,
    Envelope,
    Event,
    GpuInventoryReported,
    MessageRejected,
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
    Share,
)

_ONE_POD_EVENTS = (PodRegistered, PodReady, Assigned, Released, PodRemoved, PodRejected)


def pods_touched(event: Event) -> tuple[PodRef, ...] | None:
    """The pods whose own state (their ``PodState``, or whether they are registered at all)
    folding ``event`` may change; None: any pod of its node (a node-wide event: inventory,
    configuration, a rejection that names no pod).

    What a pod's session waits on (its phase, GPU, eviction, removal) moves only with these,
    so a reader that follows pods wakes the named ones alone; the node's indexes (queue,
    usage) move too, and a pod's place in the queue with them, but that is read when it is
    reported, not waited on. Checked against ``evolve`` over random logs
    (``tests/unit/test_core_properties.py``)."""
    if type(event) is Preempted:
        return (event.victim, event.preemptor)
    if isinstance(event, _ONE_POD_EVENTS):
        return (event.pod,)
    return None


def evolve(state: State, envelope: Envelope, holds: bool | None = None) -> State:
    """Apply one event; unknown pods/nodes in an event are ignored (the deciders never emit them).

    Besides the pods' own fields it keeps each node's indexes (``NodeState.queue``,
    ``usage``, ``shares``): every case that changes a pod takes the pod out of them
    first and puts it back after (``_unindex`` / ``_index``), so they are always what
    ``reindex`` would compute from scratch.

    ``holds``: for an Assigned, ``assignment_holds(state, event)`` when the caller has
    computed it on this same state (the projection does, once for the statistics and
    the fold); None: it is computed here. Other events ignore it.
    """
    event = envelope.event
    # the most frequent events first, by exact type (the events are final structs)
    if type(event) is PodReady:
        pod = state.pods.get(event.pod)
        if pod is not None:
            pod_ready(state.nodes.get(pod.node) or state.node(pod.node), pod, envelope.time)
        return state
    if type(event) is Assigned:
        pod = state.pods.get(event.pod)
        if pod is not None and (_holds(state, pod, event) if holds is None else holds):
            node = state.nodes.get(pod.node) or state.node(pod.node)
            if pod.phase == "ready" and pod.policy == "share-pool":
                share_pool_assigned(node, pod, event, envelope.time)
                return state
            _unindex(node, pod)
            pod.phase = "running"
            pod.gpu_index = event.gpu_index
            pod.gpu_uuid = event.gpu_uuid
            pod.running_since = envelope.time
            pod.ready_since = None
            _index(node, pod)
        return state
    if type(event) is Released:
        pod = state.pods.get(event.pod)
        if pod is not None:
            released(state, state.nodes.get(pod.node) or state.node(pod.node), pod, event)
        return state
    if type(event) is PodRejected:
        return state
    if type(event) is PodRegistered:
        _register(state, event, envelope)
        return state
    match event:
        case Preempted():
            pod = state.pods.get(event.victim)
            if pod is not None:
                pod.evicted_by = event.preemptor
                pod.evict_reason = event.reason
        case PodRegistered():
            _register(state, event, envelope)
        case PodRemoved():
            pod = state.pods.get(event.pod)
            if pod is not None:
                if pod.phase == "running":  # Releasing: the slot stays until Released
                    pod.removed = True
                else:
                    _unindex(state.node(pod.node), pod)
                    _forget(state, pod)
        case PodRejected():
            pass
        case GpuInventoryReported():
            node = state.node(event.node)
            node.gpus = event.gpus
            node.inventory_source = event.source
        case NodeConfigured():
            node = state.node(event.node)
            node.policy = event.policy
            node.qos = event.qos
            node.gpu_count = event.gpu_count
            node.rejection = None
        case NodeDisabled():
            node = state.node(event.node)
            node.policy = None
            node.rejection = None
        case NodeRejected():
            if event.node:  # a name no node can have is rejected on no node (input_bounds)
                state.node(event.node).rejection = (event.reason, event.message)
        case MessageRejected():
            seq = event.seq or _rejected_seq_of_id(envelope.id)
            if seq == 0 or seq not in state.rejected_sequences:
                state.rejected_messages += 1
            if seq:
                state.rejected_sequences.add(seq)
    return state


# The most frequent events' folds, each given the pod the event names and the pod's node,
# for a caller that has looked them up already and checked what evolve checks first (the
# projection's one-entry fold); evolve itself folds through them.


def pod_ready(node: NodeState, pod: PodState, time: datetime) -> None:
    """Fold a PodReady of ``pod`` (registered on ``node``): it joins the node's queue."""
    if pod.phase != "dormant":
        _unindex(node, pod)
    node.ready_counter += 1
    pod.phase = "ready"
    pod.ready_since = time
    pod.ready_order = node.ready_counter
    ref = pod.ref  # _index of a ready pod: its _queue_key into the queue
    insort(node.queue, (-pod.priority, pod.ready_order, ref.namespace, ref.name, ref))


def share_pool_assigned(node: NodeState, pod: PodState, event: Assigned, time: datetime) -> None:
    """Fold an Assigned that holds of a ready share-pool ``pod`` on ``node`` (the decided
    case): ``_unindex`` and ``_index`` spelt out, its queue key out and its limits in."""
    _unqueue(node, pod)
    pod.phase = "running"
    pod.gpu_index = event.gpu_index
    pod.gpu_uuid = event.gpu_uuid
    pod.running_since = time
    pod.ready_since = None
    _add_usage(node, event.gpu_index, pod.limits, 1)


def released(state: State, node: NodeState, pod: PodState, event: Released) -> None:
    """Fold a Released of ``pod`` (registered on ``node``): dormant, or gone if it was
    deleted while releasing; nothing of it left in the node's queue or usage."""
    _unindex(node, pod)
    if pod.removed:  # deleted while releasing: now its processes are gone
        _forget(state, pod)
    elif pod.policy == "static" and event.reason != "gpu-vanished":
        _static_ended(pod)  # a static pod keeps its GPU binding for its lifetime
    else:  # dormant: no GPU, no wait, no eviction pending
        pod.phase = "dormant"
        pod.gpu_index = None
        pod.gpu_uuid = ""
        pod.running_since = None
        pod.ready_since = None
        pod.evicted_by = None
        pod.evict_reason = None


def _register(state: State, event: PodRegistered, envelope: Envelope) -> None:
    earlier = state.pods.get(event.pod)
    if earlier is not None:
        _unindex(state.node(earlier.node), earlier)
        _count_share(state.node(earlier.node), earlier, -1)
    pod = state.pods[event.pod] = PodState(
        ref=event.pod,
        node=event.node,
        policy=event.policy,
        requests=event.requests,
        limits=event.limits,
        priority=event.priority,
        uid=event.uid,
        registered_at=envelope.time,
    )
    node = state.node(event.node)
    node.pods[event.pod] = None
    _count_share(node, pod, 1)


_NO_SHARE = Share(core=0, memory=0)


def _queue_key(pod: PodState) -> QueueKey:
    return (-pod.priority, pod.ready_order, pod.ref.namespace, pod.ref.name, pod.ref)


def _add_usage(node: NodeState, index: int, share: Share, sign: int) -> None:
    usage = node.usage
    held = usage.get(index, _NO_SHARE)
    core = held.core + sign * share.core
    memory = held.memory + sign * share.memory
    if core == 0 and memory == 0:
        usage.pop(index, None)
    else:
        found = _SHARES.get((core, memory))  # _share(core, memory), its lookup spelt out
        usage[index] = found if found is not None else _share(core, memory)


_SHARES: dict[tuple[int, int], Share] = {}


def _share(core: int, memory: int) -> Share:
    """``Share(core=core, memory=memory)``, one instance per value (the usage index holds the
    same few sums again and again: equal shares that are one object compare and hash at
    once in the decisions' memo keys)."""
    found = _SHARES.get((core, memory))
    if found is None:
        if len(_SHARES) >= 65536:
            _SHARES.clear()
        found = _SHARES[(core, memory)] = Share(core=core, memory=memory)
    return found


def _index(node: NodeState, pod: PodState) -> None:
    """Count ``pod``'s phase in its node's queue and usage, as it is now."""
    phase = pod.phase
    if phase == "ready":
        insort(node.queue, _queue_key(pod))
    elif phase == "running" and pod.gpu_index is not None and pod.policy == "share-pool":
        _add_usage(node, pod.gpu_index, pod.limits, 1)


def _unindex(node: NodeState, pod: PodState) -> None:
    """Take ``pod``'s phase out of its node's queue and usage (before the phase changes)."""
    phase = pod.phase
    if phase == "ready":
        _unqueue(node, pod)
    elif phase == "running" and pod.gpu_index is not None and pod.policy == "share-pool":
        _add_usage(node, pod.gpu_index, pod.limits, -1)


def _unqueue(node: NodeState, pod: PodState) -> None:
    """Take a ready ``pod``'s key out of its node's queue."""
    queue = node.queue
    if queue:
        head = queue[0]
        if head[4] == pod.ref and head == _queue_key(pod):  # most often: it was just assigned
            del queue[0]
            return
    key = _queue_key(pod)
    at = bisect_left(queue, key)
    if at < len(queue) and queue[at] == key:
        del queue[at]


def _count_share(node: NodeState, pod: PodState, sign: int) -> None:
    """Count ``pod`` (registered on ``node``, or forgotten: ``sign`` -1) in the node's workload
    and its requests."""
    held, wants = node.requested, pod.requests
    node.requested = Share(
        core=held.core + sign * wants.core, memory=held.memory + sign * wants.memory
    )
    if pod.policy == "share-pool":
        left = node.shares.get(pod.limits, 0) + sign
        if left > 0:
            node.shares[pod.limits] = left
        else:
            node.shares.pop(pod.limits, None)


def reindex(state: State) -> State:
    """Compute every node's indexes from the pods (a state built other than by ``evolve``)."""
    for node in state.nodes.values():
        node.queue = []
        node.usage = {}
        node.shares = {}
        node.requested = _NO_SHARE
    for pod in state.pods.values():
        node = state.node(pod.node)
        _index(node, pod)
        _count_share(node, pod, 1)
    return state


def assignment_holds(state: State, event: Assigned) -> bool:
    """Whether an Assigned takes effect when folded onto ``state`` (else it is a no-op).

    A share-pool Assigned is decided with an expectation that covers only the other
    claims on the node's GPUs (docs/eventlog.md), so it may reach the log after an
    entry it did not see: the pod cancelled, was deleted (or deleted and registered
    again), or its GPU vanished. Such an Assigned claims nothing: it holds only for a
    pod still waiting, on a GPU of the node's inventory (same index and UUID), where
    its limits fit beside the pods running there. The rule reads only the state the
    log folded to, so every replica folds the same log to the same state.
    Static bindings are decided under the node-wide expectation and always hold.
    """
    pod = state.pods.get(event.pod)
    return pod is not None and _holds(state, pod, event)


def _holds(state: State, pod: PodState, event: Assigned) -> bool:
    if pod.policy != "share-pool":
        return True
    if pod.phase != "ready" or pod.removed or pod.node != event.node:
        return False
    node = state.nodes.get(pod.node)
    if node is None:
        return False
    index, gpus = event.gpu_index, node.gpus
    if 0 <= index < len(gpus) and gpus[index].index == index:  # _in_inventory's usual layout
        if gpus[index].uuid != event.gpu_uuid:
            return False
    elif not _in_inventory(node, index, event.gpu_uuid):
        return False
    held = node.usage.get(event.gpu_index, _NO_SHARE)
    return (
        held.core + pod.limits.core <= GPU_PERCENT
        and held.memory + pod.limits.memory <= GPU_PERCENT
    )


def _in_inventory(node: NodeState, index: int, uuid: str) -> bool:
    gpus = node.gpus
    if 0 <= index < len(gpus) and gpus[index].index == index:  # the usual layout: O(1)
        return gpus[index].uuid == uuid
    return any(gpu.index == index and gpu.uuid == uuid for gpu in gpus)


REJECTION_ID_PREFIX = "rejected-"
"""Rejections written before MessageRejected named its sequence carry it in their id."""


def _rejected_seq_of_id(envelope_id: str) -> int:
    if envelope_id.startswith(REJECTION_ID_PREFIX):
        tail = envelope_id[len(REJECTION_ID_PREFIX) :]
        if tail.isdigit():
            return int(tail)
    return 0


def _forget(state: State, pod: PodState) -> None:
    """Drop a pod (already taken out of its node's queue and usage)."""
    state.pods.pop(pod.ref, None)
    node = state.node(pod.node)
    node.pods.pop(pod.ref, None)
    _count_share(node, pod, -1)


def _static_ended(pod: PodState) -> None:
    pod.phase = "dormant"
    pod.running_since = None
    pod.ready_since = None


def fold(envelopes: list[Envelope], state: State | None = None) -> State:
    """Fold a whole log from scratch (or onto ``state``)."""
    folded = state if state is not None else State()
    for envelope in envelopes:
        evolve(folded, envelope)
    return folded
