"""The pod watch cache: pods by name, by UID and by node, and what gpupool reads from them."""

from __future__ import annotations

import asyncio

from gpupool.core.validation import (
    COMPUTE_CLASS,
    COMPUTE_CLASS_LABEL,
    EXCLUSIVE_GPU_RESOURCE,
    SHARE_RESOURCES,
    ContainerResources,
    PodManifest,
    parse_quantity,
)
from gpupool.events import PodRef, Share
from gpupool.kube.records import Container, Pod, PodChange, Quantity


def is_gpu_hpn(pod: Pod) -> bool:
    """Labelled ``alibabacloud.com/compute-class: gpu-hpn``: gpupool registers it."""
    return pod.metadata.labels.get(COMPUTE_CLASS_LABEL) == COMPUTE_CLASS


def _asks(container: Container, resource: str) -> bool:
    for table in (container.resources.requests, container.resources.limits):
        if resource in table and _positive(table[resource]):
            return True
    return False


def _positive(value: Quantity) -> bool:
    try:
        return parse_quantity(str(value)) > 0
    except ValueError:
        return True


def asks_gpu_share(pod: Pod) -> bool:
    return any(_asks(c, r) for c in pod.spec.containers for r in SHARE_RESOURCES)


def asks_exclusive_gpu(pod: Pod) -> bool:
    """Requests whole GPUs (``nvidia.com/gpu``) and no GPU-share resources."""
    whole = any(_asks(c, EXCLUSIVE_GPU_RESOURCE) for c in pod.spec.containers)
    return whole and not asks_gpu_share(pod)


def share_requests(pod: Pod) -> Share:
    """The pod's requested GPU-share percentages, summed over its containers (0 if unreadable)."""
    core = memory = 0
    for container in pod.spec.containers:
        core += _integer(container.resources.requests.get(SHARE_RESOURCES[0]))
        memory += _integer(container.resources.requests.get(SHARE_RESOURCES[1]))
    return Share(core=core, memory=memory)


def _integer(value: Quantity | None) -> int:
    if value is None:
        return 0
    try:
        return int(parse_quantity(str(value)))
    except ValueError:
        return 0


def pod_manifest(pod: Pod) -> PodManifest:
    """What the core validates: node, priority (``spec.priority``), labels, containers' resources."""
    return PodManifest(
        namespace=pod.metadata.namespace,
        name=pod.metadata.name,
        node=pod.spec.node_name,
        uid=pod.metadata.uid,
        labels=dict(pod.metadata.labels),
        priority=pod.spec.priority or 0,
        containers=tuple(
            ContainerResources(
                name=c.name,
                requests=dict(c.resources.requests),
                limits=dict(c.resources.limits),
            )
            for c in pod.spec.containers
        ),
    )


class PodDirectory:
    """Every pod the watch has seen, indexed for the controllers, the extender and the node-executor.

    ``synced`` is set after the first complete list: before that, "no exclusive-GPU
    pod on this node" cannot be trusted.
    """

    def __init__(self) -> None:
        self._pods: dict[PodRef, Pod] = {}
        self._uids: dict[str, PodRef] = {}
        self._by_node: dict[str, dict[PodRef, None]] = {}
        self.synced = asyncio.Event()

    def apply(self, change: PodChange) -> Pod | None:
        """Record the change; return the pod as it was before (None if it was unknown)."""
        pod = change.object
        ref = pod.ref
        before = self._pods.pop(ref, None)
        if before is not None:
            self._uids.pop(before.metadata.uid, None)
            self._by_node.get(before.node_name, {}).pop(ref, None)
        if change.type != "DELETED":
            self._pods[ref] = pod
            if pod.metadata.uid:
                self._uids[pod.metadata.uid] = ref
            if pod.node_name:
                self._by_node.setdefault(pod.node_name, {})[ref] = None
        return before

    def get(self, ref: PodRef) -> Pod | None:
        return self._pods.get(ref)

    def by_uid(self, uid: str) -> PodRef | None:
        """The pod (namespace/name) with this UID, e.g. found in a process's cgroup path."""
        return self._uids.get(uid)

    def uid_of(self, ref: PodRef) -> str:
        pod = self._pods.get(ref)
        return pod.metadata.uid if pod is not None else ""

    def all(self) -> list[Pod]:
        return list(self._pods.values())

    def on_node(self, node: str) -> list[Pod]:
        return [self._pods[ref] for ref in self._by_node.get(node, {})]

    def exclusive_gpu_pods(self, node: str) -> tuple[str, ...]:
        """Running or pending pods bound to ``node`` that request whole GPUs: they block enabling."""
        return tuple(
            sorted(
                str(pod.ref)
                for pod in self.on_node(node)
                if asks_exclusive_gpu(pod) and not pod.terminated
            )
        )

    def share_usage(self, node: str, *, excluding: PodRef | None = None) -> Share:
        """Sum of the GPU-share requests of the live pods bound to ``node``."""
        core = memory = 0
        for pod in self.on_node(node):
            if pod.ref == excluding or pod.terminated or not asks_gpu_share(pod):
                continue
            requests = share_requests(pod)
            core += requests.core
            memory += requests.memory
        return Share(core=core, memory=memory)

    def __len__(self) -> int:
        return len(self._pods)
