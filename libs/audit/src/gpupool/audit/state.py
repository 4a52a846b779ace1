"""``gpupool state``'s model and the console's cluster and node pages: each node at a moment.

Its GPUs and the pods holding them, its ready queue with positions, waits so far
and estimated remaining waits, its dormant pods, its requests against allocatable.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

import msgspec

from gpupool.audit.errors import AuditError
from gpupool.audit.estimate import WaitEstimate, estimate_wait
from gpupool.audit.fold import Hold, fold_until
from gpupool.audit.log import log_origin
from gpupool.core import NodeState, PodState, State, gpu_usage, ready_queue
from gpupool.core.placement import GpuUsage, allocated_requests, static_usage
from gpupool.eventlog.port import Entry, StoredEvent
from gpupool.events import PodRef, QosConfig, Share


class PodSlot(msgspec.Struct, frozen=True, kw_only=True):
    """A pod holding a slot on a GPU."""

    pod: PodRef
    policy: str
    requests: Share
    limits: Share
    priority: int
    since: datetime | None
    evicted_by: PodRef | None = None
    evict_reason: str | None = None


class GpuView(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    uuid: str
    used: Share
    """Sum over the pods holding it: of limits (share-pool), of requests (static)."""
    basis: str
    pods: list[PodSlot]


class QueuedPod(msgspec.Struct, frozen=True, kw_only=True):
    position: int
    pod: PodRef
    priority: int
    limits: Share
    ready_since: datetime | None
    waited: timedelta | None = None
    """How long it has waited at the view's moment."""
    estimate: WaitEstimate | None = None
    """Its estimated remaining wait (ETA = the view's moment + ``estimate.wait``)."""


class NodeView(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    policy: str | None
    qos: QosConfig
    inventory_source: str | None
    gpus: list[GpuView]
    queue: list[QueuedPod]
    dormant: list[PodRef]
    requested: Share
    allocatable: int
    rejection: tuple[str, str] | None


class StateView(msgspec.Struct, frozen=True, kw_only=True):
    at: datetime
    origin: datetime
    last: StoredEvent | None
    entries: int
    nodes: list[NodeView]


def node_usage(node: NodeState, pods: list[PodState]) -> tuple[GpuUsage, str]:
    """Per-GPU use by limits (share-pool) or by requests (static), and which basis it is."""
    if node.policy == "static":
        return static_usage(node, pods), "requests"
    return gpu_usage(node, pods), "limits"


def node_view(
    state: State, name: str, at: datetime | None = None, holds: Sequence[Hold] = ()
) -> NodeView:
    node = state.nodes[name]
    pods = state.pods_on(name)
    usage, basis = node_usage(node, pods)
    uuids = {gpu.index: gpu.uuid for gpu in node.gpus}
    holders: dict[int, list[PodSlot]] = {}
    for pod in pods:
        if pod.gpu_index is not None:
            holders.setdefault(pod.gpu_index, []).append(
                PodSlot(
                    pod=pod.ref,
                    policy=pod.policy,
                    requests=pod.requests,
                    limits=pod.limits,
                    priority=pod.priority,
                    since=pod.running_since,
                    evicted_by=pod.evicted_by,
                    evict_reason=pod.evict_reason,
                )
            )
    indexes = sorted(set(usage) | set(holders))
    gpus = [
        GpuView(
            index=index,
            uuid=uuids.get(index, ""),
            used=usage.get(index, Share(core=0, memory=0)),
            basis=basis,
            pods=holders.get(index, []),
        )
        for index in indexes
    ]
    queue = [
        QueuedPod(
            position=position,
            pod=pod.ref,
            priority=pod.priority,
            limits=pod.limits,
            ready_since=pod.ready_since,
            waited=at - pod.ready_since if at is not None and pod.ready_since else None,
            estimate=estimate_wait(node, position, holds),
        )
        for position, pod in enumerate(ready_queue(state, name), start=1)
    ]
    dormant = [pod.ref for pod in pods if pod.phase == "dormant" and pod.gpu_index is None]
    return NodeView(
        name=name,
        policy=node.policy,
        qos=node.qos,
        inventory_source=node.inventory_source,
        gpus=gpus,
        queue=queue,
        dormant=dormant,
        requested=allocated_requests(pods),
        allocatable=node.allocatable_percent,
        rejection=node.rejection,
    )


def state_at(
    entries: Sequence[Entry], at: datetime | None = None, node: str | None = None
) -> StateView:
    """Fold the log up to ``at`` (None: all of it, at its last entry) and view each node."""
    origin = log_origin(entries)
    if origin is None:
        raise AuditError("the log has no readable entries")
    folded = fold_until(entries, at)
    if at is None:
        at = folded.last.envelope.time if folded.last is not None else origin
    names = sorted(folded.state.nodes)
    if node is not None:
        if node not in folded.state.nodes:
            known = ", ".join(names) or "none"
            raise AuditError(f"node {node!r} is not in the log at that time (nodes: {known})")
        names = [node]
    return StateView(
        at=at,
        origin=origin,
        last=folded.last,
        entries=folded.entries,
        nodes=[node_view(folded.state, name, at, folded.holds) for name in names],
    )
