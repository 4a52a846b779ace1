"""Snapshots of a projection: its state, statistics and the stream sequence they cover, as msgpack.

A snapshot is a cache of the fold, never the truth: resuming from one and folding
the rest of the log gives exactly what folding the whole log from zero gives
(tests/unit/test_observability_snapshot.py checks it). A snapshot whose format
this code does not know is refused (:class:`SnapshotFormatError`); the caller then
rebuilds from zero.

The core ``State`` is a dataclass tree with dicts keyed by ``PodRef``; it is
converted explicitly, field by field, into the records below (dicts keyed by
Structs become lists, in their order). Format history (``Snapshot.format``):

* 1 — the first format.

A change to ``State``, ``NodeState`` or ``PodState`` needs a change here and,
unless it only adds a field with a default, a new format number.
"""

from __future__ import annotations

from datetime import datetime

import msgspec

from gpupool.core import NodeState, Phase, PodState, State
from gpupool.core.evolve import reindex
from gpupool.events import GpuInfo, InventorySource, PodRef, Policy, PreemptReason, QosConfig, Share
from gpupool.runtime.statistics import LogStatistics

SNAPSHOT_FORMAT = 1


class SnapshotFormatError(ValueError):
    """The bytes are not a snapshot this code can read (the message says why)."""


class PodRecord(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """A ``PodState``, field for field."""

    ref: PodRef
    node: str
    policy: Policy
    requests: Share
    limits: Share
    priority: int
    uid: str
    registered_at: datetime
    phase: Phase
    ready_since: datetime | None
    ready_order: int
    gpu_index: int | None
    gpu_uuid: str
    running_since: datetime | None
    evicted_by: PodRef | None
    evict_reason: PreemptReason | None
    removed: bool = False


class NodeRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A ``NodeState``; ``pods`` (an ordered set keyed by PodRef) becomes a list in its order."""

    name: str
    policy: Policy | None
    qos: QosConfig
    gpu_count: int
    gpus: tuple[GpuInfo, ...]
    inventory_source: InventorySource | None
    rejection: tuple[str, str] | None
    pods: list[PodRef]
    ready_counter: int


class StateRecord(msgspec.Struct, frozen=True, kw_only=True):
    nodes: list[NodeRecord]
    pods: list[PodRecord]
    """In the order of ``State.pods``."""
    rejected_messages: int
    rejected_sequences: list[int] = []


class Snapshot(msgspec.Struct, frozen=True, kw_only=True):
    """A projection at stream sequence ``last_seq``: resume by applying ``last_seq + 1`` onwards."""

    format: int
    last_seq: int
    node_seq: dict[str, int]
    undecodable: int
    ahead: list[int]
    """Sequences above ``last_seq`` already applied (see ``Projection.ahead``)."""
    state: StateRecord
    statistics: LogStatistics | None = None
    open_entry: tuple[int, int] | None = None
    """A decision entry folded in part when the snapshot was taken (see ``Projection``)."""
    applied_ids: list[str] = []
    """The last envelope ids applied, oldest first (``Projection.envelope_ids``: replays);
    empty in snapshots written before it."""
    writer_seq: list[tuple[str, str, int]] = []
    """(node, writer token, last sequence) of each subject folded (see ``Projection.writer_seq``)."""
    ahead_nodes: list[tuple[int, str]] = []
    """(sequence, node) of the entries in ``ahead`` (see ``Projection.ahead_nodes``); empty in
    snapshots written before it, whose ``node_seq`` already counts those entries."""


class _FormatProbe(msgspec.Struct):
    format: int


def pod_record(pod: PodState) -> PodRecord:
    return PodRecord(
        ref=pod.ref,
        node=pod.node,
        policy=pod.policy,
        requests=pod.requests,
        limits=pod.limits,
        priority=pod.priority,
        uid=pod.uid,
        registered_at=pod.registered_at,
        phase=pod.phase,
        ready_since=pod.ready_since,
        ready_order=pod.ready_order,
        gpu_index=pod.gpu_index,
        gpu_uuid=pod.gpu_uuid,
        running_since=pod.running_since,
        evicted_by=pod.evicted_by,
        evict_reason=pod.evict_reason,
        removed=pod.removed,
    )


def pod_state(record: PodRecord) -> PodState:
    return PodState(
        ref=record.ref,
        node=record.node,
        policy=record.policy,
        requests=record.requests,
        limits=record.limits,
        priority=record.priority,
        uid=record.uid,
        registered_at=record.registered_at,
        phase=record.phase,
        ready_since=record.ready_since,
        ready_order=record.ready_order,
        gpu_index=record.gpu_index,
        gpu_uuid=record.gpu_uuid,
        running_since=record.running_since,
        evicted_by=record.evicted_by,
        evict_reason=record.evict_reason,
        removed=record.removed,
    )


def node_record(node: NodeState) -> NodeRecord:
    return NodeRecord(
        name=node.name,
        policy=node.policy,
        qos=node.qos,
        gpu_count=node.gpu_count,
        gpus=node.gpus,
        inventory_source=node.inventory_source,
        rejection=node.rejection,
        pods=list(node.pods),
        ready_counter=node.ready_counter,
    )


def node_state(record: NodeRecord) -> NodeState:
    return NodeState(
        name=record.name,
        policy=record.policy,
        qos=record.qos,
        gpu_count=record.gpu_count,
        gpus=record.gpus,
        inventory_source=record.inventory_source,
        rejection=record.rejection,
        pods=dict.fromkeys(record.pods),
        ready_counter=record.ready_counter,
    )


def state_record(state: State) -> StateRecord:
    return StateRecord(
        nodes=[node_record(node) for node in state.nodes.values()],
        pods=[pod_record(pod) for pod in state.pods.values()],
        rejected_messages=state.rejected_messages,
        rejected_sequences=sorted(state.rejected_sequences),
    )


def state_from_record(record: StateRecord) -> State:
    """The state a record holds, with the node indexes ``evolve`` keeps computed again."""
    return reindex(
        State(
            nodes={node.name: node_state(node) for node in record.nodes},
            pods={pod.ref: pod_state(pod) for pod in record.pods},
            rejected_messages=record.rejected_messages,
            rejected_sequences=set(record.rejected_sequences),
        )
    )


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Snapshot)
_probe = msgspec.msgpack.Decoder(_FormatProbe)


def encode_snapshot(snapshot: Snapshot) -> bytes:
    return _encoder.encode(snapshot)


def decode_snapshot(data: bytes) -> Snapshot:
    """Read a snapshot; raise SnapshotFormatError if it is damaged or of an unknown format."""
    try:
        version = _probe.decode(data).format
    except msgspec.DecodeError as exc:
        raise SnapshotFormatError(f"not a gpupool projection snapshot: {exc}") from exc
    if version != SNAPSHOT_FORMAT:
        raise SnapshotFormatError(
            f"snapshot format {version} is unknown to this gpupool (it reads {SNAPSHOT_FORMAT})"
        )
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise SnapshotFormatError(f"invalid snapshot: {exc}") from exc
