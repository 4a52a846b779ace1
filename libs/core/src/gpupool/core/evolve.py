"""evolve(state, envelope): fold one logged fact into the state. No decisions here."""

from __future__ import annotations

from gpupool.core.state import GPU_PERCENT, PodState, State
from gpupool.events import (
    Assigned,
    Envelope,
    GpuInventoryReported,
    MessageRejected,
    NodeConfigured,
    NodeDisabled,
    NodeRejected,
    PodReady,
    PodRegistered,
    PodRejected,
    PodRemoved,
    Preempted,
    Released,
)


def evolve(state: State, envelope: Envelope) -> State:
    """Apply one event; unknown pods/nodes in an event are ignored (the deciders never emit them)."""
    event = envelope.event
    match event:
        # the most frequent events first: a match tries its cases in order
        case PodReady():
            pod = state.pods.get(event.pod)
            if pod is not None:
                node = state.node(pod.node)
                node.ready_counter += 1
                pod.phase = "ready"
                pod.ready_since = envelope.time
                pod.ready_order = node.ready_counter
        case Assigned():
            pod = state.pods.get(event.pod)
            if pod is not None and assignment_holds(state, event):
                pod.phase = "running"
                pod.gpu_index = event.gpu_index
                pod.gpu_uuid = event.gpu_uuid
                pod.running_since = envelope.time
                pod.ready_since = None
        case Released():
            pod = state.pods.get(event.pod)
            if pod is not None:
                if pod.removed:  # deleted while releasing: now its processes are gone
                    _forget(state, pod)
                elif pod.policy == "static" and event.reason != "gpu-vanished":
                    _static_ended(pod)  # a static pod keeps its GPU binding for its lifetime
                else:
                    _to_dormant(pod)
        case Preempted():
            pod = state.pods.get(event.victim)
            if pod is not None:
                pod.evicted_by = event.preemptor
                pod.evict_reason = event.reason
        case PodRegistered():
            state.pods[event.pod] = PodState(
                ref=event.pod,
                node=event.node,
                policy=event.policy,
                requests=event.requests,
                limits=event.limits,
                priority=event.priority,
                uid=event.uid,
                registered_at=envelope.time,
            )
            state.node(event.node).pods[event.pod] = None
        case PodRemoved():
            pod = state.pods.get(event.pod)
            if pod is not None:
                if pod.phase == "running":  # Releasing: the slot stays until Released
                    pod.removed = True
                else:
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
            state.node(event.node).rejection = (event.reason, event.message)
        case MessageRejected():
            seq = event.seq or _rejected_seq_of_id(envelope.id)
            if seq == 0 or seq not in state.rejected_sequences:
                state.rejected_messages += 1
            if seq:
                state.rejected_sequences.add(seq)
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
    if pod is None:
        return False
    if pod.policy != "share-pool":
        return True
    if pod.phase != "ready" or pod.removed or pod.node != event.node:
        return False
    node = state.nodes.get(pod.node)
    if node is None or not any(
        gpu.index == event.gpu_index and gpu.uuid == event.gpu_uuid for gpu in node.gpus
    ):
        return False
    core = pod.limits.core
    memory = pod.limits.memory
    pods = state.pods
    for ref in node.pods:
        other = pods[ref]
        if (
            other.phase == "running"
            and other.gpu_index == event.gpu_index
            and other.policy == "share-pool"
        ):
            core += other.limits.core
            memory += other.limits.memory
    return core <= GPU_PERCENT and memory <= GPU_PERCENT


REJECTION_ID_PREFIX = "rejected-"
"""Rejections written before MessageRejected named its sequence carry it in their id."""


def _rejected_seq_of_id(envelope_id: str) -> int:
    if envelope_id.startswith(REJECTION_ID_PREFIX):
        tail = envelope_id[len(REJECTION_ID_PREFIX) :]
        if tail.isdigit():
            return int(tail)
    return 0


def _forget(state: State, pod: PodState) -> None:
    state.pods.pop(pod.ref, None)
    state.node(pod.node).pods.pop(pod.ref, None)


def _static_ended(pod: PodState) -> None:
    pod.phase = "dormant"
    pod.running_since = None
    pod.ready_since = None


def _to_dormant(pod: PodState) -> None:
    pod.phase = "dormant"
    pod.gpu_index = None
    pod.gpu_uuid = ""
    pod.running_since = None
    pod.ready_since = None
    pod.evicted_by = None
    pod.evict_reason = None


def fold(envelopes: list[Envelope], state: State | None = None) -> State:
    """Fold a whole log from scratch (or onto ``state``)."""
    folded = state if state is not None else State()
    for envelope in envelopes:
        evolve(folded, envelope)
    return folded
