"""The parts of Kubernetes objects gpupool reads and writes, as msgspec Structs.

The Structs mirror the Kubernetes JSON (camelCase on the wire), so a watch line
decodes straight into them; every field we do not name is ignored. Quantities
stay as the API spells them (strings; ints are accepted too, as in hand-written
manifests).
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from typing import Generic, Literal, TypeVar

import msgspec

from gpupool.events import PodRef

Quantity = str | int
ResourceList = dict[str, Quantity]

ChangeType = Literal["ADDED", "MODIFIED", "DELETED"]


def kube_time(moment: datetime) -> str:
    """A Kubernetes timestamp: RFC 3339 in UTC, second precision (``2025-01-07T04:13:04Z``)."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ObjectMeta(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    name: str = ""
    namespace: str = ""
    uid: str = ""
    resource_version: str = ""
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}
    deletion_timestamp: str | None = None


# --------------------------------------------------------------------------- nodes


class NodeCondition(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    """One entry of ``status.conditions`` of a node (read and written)."""

    type: str
    status: str
    reason: str = ""
    message: str = ""
    last_heartbeat_time: str | None = None
    last_transition_time: str | None = None


class NodeStatus(msgspec.Struct, frozen=True, kw_only=True):
    capacity: ResourceList = {}
    allocatable: ResourceList = {}
    conditions: tuple[NodeCondition, ...] = ()


class Node(msgspec.Struct, frozen=True, kw_only=True):
    metadata: ObjectMeta
    status: NodeStatus = NodeStatus()

    @property
    def name(self) -> str:
        return self.metadata.name

    def condition(self, type_: str) -> NodeCondition | None:
        return next((c for c in self.status.conditions if c.type == type_), None)


# --------------------------------------------------------------------------- pods


class ResourceRequirements(msgspec.Struct, frozen=True, kw_only=True):
    requests: ResourceList = {}
    limits: ResourceList = {}


class Container(msgspec.Struct, frozen=True, kw_only=True):
    name: str = ""
    resources: ResourceRequirements = ResourceRequirements()


class KubePodSpec(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """``spec`` of a pod: where it is bound, its priority and its containers' resources."""

    node_name: str = ""
    priority: int | None = None
    containers: tuple[Container, ...] = ()


class KubePodStatus(msgspec.Struct, frozen=True, kw_only=True):
    phase: str = ""


class Pod(msgspec.Struct, frozen=True, kw_only=True):
    metadata: ObjectMeta
    spec: KubePodSpec = KubePodSpec()
    status: KubePodStatus = KubePodStatus()

    @property
    def ref(self) -> PodRef:
        return PodRef(namespace=self.metadata.namespace, name=self.metadata.name)

    @property
    def node_name(self) -> str:
        return self.spec.node_name

    @property
    def terminated(self) -> bool:
        """Succeeded or Failed: it holds no resources any more."""
        return self.status.phase in ("Succeeded", "Failed")


# --------------------------------------------------------------------------- watch records

T = TypeVar("T")


class Change(msgspec.Struct, Generic[T], frozen=True, kw_only=True):
    """One change seen by a list+watch: the object as it is now (as it was last, for DELETED)."""

    type: ChangeType
    object: T


class Synced(msgspec.Struct, frozen=True, kw_only=True):
    """A (re-)list finished: everything before this record is the complete current state."""

    resource_version: str = ""


NodeChange = Change[Node]
PodChange = Change[Pod]


# --------------------------------------------------------------------------- writes


class NodeStatusPatch(msgspec.Struct, frozen=True, kw_only=True):
    """Keys gpupool owns in a node's status; a None value removes the key."""

    capacity: dict[str, str | None] = {}
    allocatable: dict[str, str | None] = {}
    conditions: tuple[NodeCondition, ...] = ()


class PodCondition(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    type: str
    status: str
    reason: str = ""
    message: str = ""
    last_probe_time: str | None = None
    last_transition_time: str | None = None


class PodEvent(msgspec.Struct, frozen=True, kw_only=True):
    """A core/v1 Event about a pod (what ``kubectl describe pod`` lists)."""

    name: str
    """The Event object's name (``<pod>.<suffix>``): a repeated create with the same name is a no-op."""
    pod: PodRef
    pod_uid: str = ""
    type: Literal["Normal", "Warning"] = "Warning"
    reason: str
    message: str
    time: str
    """RFC 3339, second precision, UTC (``2025-04-22T08:12:09Z``)."""
    source_component: str = "gpushare"
    reporting_component: str = "gpupool"


def pod_event_name(pod_name: str, *parts: str) -> str:
    """``<pod-name>.<16 hex>`` derived from ``parts``: recording the same fact twice is a no-op."""
    digest = hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:16]
    return f"{pod_name[:236]}.{digest}"
