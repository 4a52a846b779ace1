"""The state the log folds into: nodes, their GPUs and the pods registered on them.

State is mutable and owned by whoever folds it (``evolve`` updates it in place and
returns it). ``decide`` never mutates it: it plans on copies (see ``decide.py``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from gpupool.events import GpuInfo, InventorySource, PodRef, Policy, PreemptReason, QosConfig, Share

Phase = Literal["dormant", "ready", "running"]

GPU_PERCENT = 100
"""One GPU is 100 percent of compute and 100 percent of memory."""


@dataclass(slots=True)
class PodState:
    ref: PodRef
    node: str
    policy: Policy
    requests: Share
    limits: Share
    priority: int
    uid: str
    registered_at: datetime
    phase: Phase = "dormant"
    ready_since: datetime | None = None
    ready_order: int = 0
    """Per-node counter taken when the pod became ready: FIFO tie-break within a priority."""
    gpu_index: int | None = None
    gpu_uuid: str = ""
    running_since: datetime | None = None
    evicted_by: PodRef | None = None
    """Set by Preempted: the pod keeps its slot until its release is recorded."""
    evict_reason: PreemptReason | None = None
    removed: bool = False
    """Deleted while it held a slot: it keeps the slot until its Released is recorded."""

    @property
    def releasing(self) -> bool:
        """Its processes are being ended (preempted or deleted): its slot still counts."""
        return self.phase == "running" and (self.evicted_by is not None or self.removed)


NODE_INDEXES = ("queue", "usage", "shares", "requested")
"""NodeState fields derived from the pods (kept by ``evolve``, computed by ``reindex``): a
snapshot does not store them."""

QueueKey = tuple[int, int, str, str, PodRef]
"""(-priority, ready_order, namespace, name, pod): the ready-queue order (``queue_order_key``)."""


@dataclass(slots=True)
class NodeState:
    name: str
    policy: Policy | None = None
    """None: not enabled (never configured, disabled, or only its inventory is known)."""
    qos: QosConfig = field(default_factory=QosConfig)
    gpu_count: int = 0
    """GPU count the policy service saw when it enabled the node (allocatable before inventory)."""
    gpus: tuple[GpuInfo, ...] = ()
    inventory_source: InventorySource | None = None
    rejection: tuple[str, str] | None = None
    """The last NodeRejected (reason, message) since the last accepted configuration."""
    pods: dict[PodRef, None] = field(default_factory=dict)
    """Pods registered on this node, in registration order (a dict used as an ordered set)."""
    ready_counter: int = 0
    queue: list[QueueKey] = field(default_factory=list)
    """The ready queue, head first: a key per ready pod, kept sorted by ``evolve``."""
    usage: dict[int, Share] = field(default_factory=dict)
    """Per GPU index: the summed limits of the share-pool pods running there (kept by
    ``evolve``; an index with nothing running has no entry)."""
    shares: dict[Share, int] = field(default_factory=dict)
    """How many registered share-pool pods have each limits share (the node's workload)."""
    requested: Share = field(default_factory=lambda: Share(core=0, memory=0))
    """The summed requests of the pods registered on this node, any policy (admission by
    requests: ``allocated_requests``)."""

    @property
    def enabled(self) -> bool:
        return self.policy is not None

    @property
    def allocatable_percent(self) -> int:
        count = len(self.gpus) if self.gpus else self.gpu_count
        return GPU_PERCENT * count


@dataclass(slots=True)
class State:
    nodes: dict[str, NodeState] = field(default_factory=dict)
    pods: dict[PodRef, PodState] = field(default_factory=dict)
    rejected_messages: int = 0
    rejected_sequences: set[int] = field(default_factory=set)
    """Log sequences whose MessageRejected is folded: each is set aside once, forever."""

    def node(self, name: str) -> NodeState:
        """The node's state, created empty on first mention."""
        found = self.nodes.get(name)
        if found is None:
            found = self.nodes[name] = NodeState(name=name)
        return found

    def pods_on(self, node: str) -> list[PodState]:
        found = self.nodes.get(node)
        if found is None:
            return []
        return [self.pods[ref] for ref in found.pods]

    def copy(self) -> State:
        return copy.deepcopy(self)
