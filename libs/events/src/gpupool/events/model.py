"""The event types and the value types they carry."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

import msgspec

from gpupool.events.limits import (
    MAX_GPUS_PER_NODE,
    DurationMinutes,
    ExitCode,
    GpuCount,
    GpuIndex,
    GraceSeconds,
    Id,
    MemoryMiB,
    Message,
    Namespace,
    NodeName,
    Percent,
    PeriodSeconds,
    PodName,
    Priority,
    Sequence,
    Subject,
    Text,
)

Policy = Literal["share-pool", "static"]
"""The GPU-share model of a node or pod (``none`` disables a node: see NodeDisabled)."""

ReleaseReason = Literal[
    "completed", "preempted", "out-of-memory", "failed", "cancelled", "gpu-vanished"
]
"""Why a pod left its GPU; ``gpu-vanished``: the GPU is no longer in the node's inventory."""
PreemptReason = Literal["priority", "max-duration"]
InventorySource = Literal["nvml", "simulated"]

NODELESS = ""
"""The ``node`` of an event that belongs to no node (a message rejected before it was read)."""


class PodRef(msgspec.Struct, frozen=True, gc=False, kw_only=True, order=True):
    """A pod, by namespace and name."""

    namespace: Namespace
    name: PodName

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def __str__(self) -> str:
        return self.key


class Share(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """Percentages of one GPU: ``alibabacloud.com/gpu-core.percentage`` and ``gpu-memory.percentage``."""

    core: Percent
    memory: Percent


class GpuInfo(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """One GPU of a node, as the node-executor discovered it (index and UUID are the node's real ones)."""

    index: GpuIndex
    uuid: Text
    memory_mib: MemoryMiB
    name: Text = ""


class QosConfig(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """The node's ``alibabacloud.com/gpu-share-qos-config`` annotation, validated.

    The first three fields are the annotation's documented ones; the others are ours
    (docs/behaviour.md) and default to the documented behaviour.
    """

    preempt_enabled: bool = False
    pod_max_duration_minutes: DurationMinutes | None = None
    reserved_ephemeral_storage: Text | None = None
    backfill: bool = False
    preempt_grace_seconds: GraceSeconds = 10
    waiting_message_period_seconds: PeriodSeconds = 10


# --------------------------------------------------------------------------- node facts


class NodeConfigured(msgspec.Struct, frozen=True, gc=False, kw_only=True, tag="NodeConfigured"):
    """The policy service enabled (or re-configured) a node for GPU sharing."""

    node: NodeName
    policy: Policy
    qos: QosConfig = QosConfig()
    gpu_count: GpuCount = 0
    """GPUs the node advertises (``nvidia.com/gpu``); allocatable until the inventory is reported."""


class NodeDisabled(msgspec.Struct, frozen=True, gc=False, kw_only=True, tag="NodeDisabled"):
    """The node's policy became ``none`` (or its label was removed)."""

    node: NodeName


class NodeRejected(msgspec.Struct, frozen=True, gc=False, kw_only=True, tag="NodeRejected"):
    """A node configuration was refused; ``reason`` is machine-readable, ``message`` for people."""

    node: NodeName
    reason: Text
    message: Message


class GpuInventoryReported(
    msgspec.Struct, frozen=True, gc=False, kw_only=True, tag="GpuInventoryReported"
):
    """The node-executor's view of the node's GPUs; ``source`` says whether they are real."""

    node: NodeName
    gpus: Annotated[tuple[GpuInfo, ...], msgspec.Meta(max_length=MAX_GPUS_PER_NODE)]
    source: InventorySource


# --------------------------------------------------------------------------- pod facts


class PodRegistered(msgspec.Struct, frozen=True, gc=False, kw_only=True, tag="PodRegistered"):
    """A valid GPU-sharing pod was admitted to its node; it starts dormant."""

    pod: PodRef
    node: NodeName
    policy: Policy
    requests: Share
    limits: Share
    priority: Priority = 0
    uid: Text = ""


class PodRejected(msgspec.Struct, frozen=True, gc=False, kw_only=True, tag="PodRejected"):
    """A pod spec, or a request made for a pod, was refused."""

    pod: PodRef
    node: NodeName
    reason: Text
    message: Message


class PodReady(msgspec.Struct, frozen=True, gc=False, kw_only=True, tag="PodReady"):
    """The pod tried to use a GPU: it joins the node's ready queue."""

    pod: PodRef
    node: NodeName


class Assigned(msgspec.Struct, frozen=True, gc=False, kw_only=True, tag="Assigned"):
    """The pod was given a slot on one GPU: it is running."""

    pod: PodRef
    node: NodeName
    gpu_index: GpuIndex
    gpu_uuid: Text


class Preempted(msgspec.Struct, frozen=True, gc=False, kw_only=True, tag="Preempted"):
    """The victim must give up its GPU so that the preemptor can run.

    The victim keeps its slot until the node-executor records its Released(preempted).
    """

    victim: PodRef
    preemptor: PodRef
    node: NodeName
    gpu_index: GpuIndex
    gpu_uuid: Text
    reason: PreemptReason


class Released(msgspec.Struct, frozen=True, gc=False, kw_only=True, tag="Released"):
    """The pod left its GPU (or, with ``gpu_index`` None, left the ready queue) and is dormant."""

    pod: PodRef
    node: NodeName
    reason: ReleaseReason
    gpu_index: GpuIndex | None = None
    gpu_uuid: Text = ""
    exit_code: ExitCode | None = None


class PodRemoved(msgspec.Struct, frozen=True, gc=False, kw_only=True, tag="PodRemoved"):
    """The pod was deleted: it leaves the queue at once.

    A pod that holds a GPU slot keeps it, *releasing*, until the node-executor
    records the end of its processes (Released); only then is it gone. No event
    frees a GPU that a process may still be using.
    """

    pod: PodRef
    node: NodeName


# --------------------------------------------------------------------------- bad input


class MessageRejected(msgspec.Struct, frozen=True, gc=False, kw_only=True, tag="MessageRejected"):
    """A message on an event subject that could not be read; set aside with the reason."""

    subject: Subject
    reason: Message
    payload: Message
    node: NodeName = NODELESS
    seq: Sequence = 0
    """The log sequence of the entry set aside (0: not known, as in logs before it was kept)."""


Event = (
    NodeConfigured
    | NodeDisabled
    | NodeRejected
    | GpuInventoryReported
    | PodRegistered
    | PodRejected
    | PodReady
    | Assigned
    | Preempted
    | Released
    | PodRemoved
    | MessageRejected
)

ALL_EVENT_TYPES: tuple[type[Event], ...] = (
    NodeConfigured,
    NodeDisabled,
    NodeRejected,
    GpuInventoryReported,
    PodRegistered,
    PodRejected,
    PodReady,
    Assigned,
    Preempted,
    Released,
    PodRemoved,
    MessageRejected,
)


class Envelope(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """One entry of the log: the event and where it came from."""

    id: Id
    time: datetime
    event: Event
    correlation_id: Id = ""
    causation_id: Id = ""
    schema: int = 2


def event_tag(event: Event) -> str:
    tag = type(event).__struct_config__.tag
    assert isinstance(tag, str)
    return tag


def event_node(event: Event) -> str:
    return event.node


def event_pod(event: Event) -> PodRef | None:
    """The pod an event is about (the victim, for Preempted)."""
    if isinstance(event, Preempted):
        return event.victim
    pod = getattr(event, "pod", None)
    return pod if isinstance(pod, PodRef) else None
