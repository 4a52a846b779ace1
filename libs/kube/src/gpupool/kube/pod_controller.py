"""Pods: register ``gpu-hpn`` pods in the core when bound, remove them when gone.

* A pod labelled ``alibabacloud.com/compute-class: gpu-hpn`` that is bound to a
  node is submitted as ``RegisterPod`` (once per distinct manifest). A
  ``PodRejected`` answer becomes a Warning Event on the pod, reason = the
  rejection's reason, message = its message, source component ``gpushare``.
* When such a pod is deleted, or has Succeeded/Failed, ``RemovePod`` is submitted.
* After every first list (each start), ``ReconcilePods`` for every node the log
  or the list names: what the log registered and the cluster no longer has (or
  has under a new UID) is removed before the listed pods are followed.
* ``retry``: a pod refused because an earlier pod of its name was still releasing
  is submitted again once that one is released.
* Whole-GPU pods (``nvidia.com/gpu``) arriving on or leaving a node, and removed
  GPU-sharing pods, make the node controller look at that node again.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from datetime import datetime
from typing import Literal

from gpupool.core import PodManifest, PresentPod, ReconcilePods, RegisterPod, RemovePod
from gpupool.events import PodRef, PodRejected, PodRemoved
from gpupool.kube.node_controller import utc_now
from gpupool.kube.pod_directory import (
    PodDirectory,
    asks_exclusive_gpu,
    is_gpu_hpn,
    pod_manifest,
)
from gpupool.kube.port import KubernetesApi, SubmitCommand
from gpupool.kube.records import (
    Change,
    Pod,
    PodChange,
    PodEvent,
    Synced,
    kube_time,
    pod_event_name,
)

log = logging.getLogger(__name__)

NodePodsChanged = Callable[[str], Awaitable[None]]


class PodController:
    def __init__(
        self,
        api: KubernetesApi,
        submit: SubmitCommand,
        pods: PodDirectory,
        *,
        node_pods_changed: NodePodsChanged | None = None,
        nodes_ready: Callable[[], Awaitable[object]] | None = None,
        registered_nodes: Callable[[], Iterable[str]] | None = None,
        clock: Callable[[], datetime] = utc_now,
    ) -> None:
        self._api = api
        self._registered_nodes = registered_nodes
        self._submit = submit
        self._pods = pods
        self._node_pods_changed = node_pods_changed
        self._nodes_ready = nodes_ready
        self._clock = clock
        self._seen: dict[str, PodManifest | Literal["removed"]] = {}
        """By pod UID (by namespace/name for a pod without one): what was last submitted."""

    async def run(self) -> None:
        """Follow the pod watch forever, keeping the directory current.

        Until the first list is complete (and the nodes it may need are configured,
        ``nodes_ready``) pods only go into the directory; then every pod listed is
        followed once, and every change after that as it comes.
        """
        async for item in self._api.watch_pods():
            if isinstance(item, Synced):
                if not self._pods.synced.is_set():
                    self._pods.synced.set()
                    await self._follow_listed()
                continue
            before = self._pods.apply(item)
            if not self._pods.synced.is_set():
                continue
            try:
                await self.on_change(item, before)
            except Exception:
                log.exception("pod %s: handling failed", item.object.ref)

    async def _follow_listed(self) -> None:
        if self._nodes_ready is not None:
            await self._nodes_ready()
        await self._reconcile()
        for pod in self._pods.all():
            if not is_gpu_hpn(pod):
                continue
            try:
                await self._follow_share_pod(Change(type="ADDED", object=pod))
            except Exception:
                log.exception("pod %s: handling failed", pod.ref)

    async def _reconcile(self) -> None:
        """Compare the log's pods with the cluster's, node by node (kopf's resume causes)."""
        present: dict[str, list[PresentPod]] = {}
        for pod in self._pods.all():
            if is_gpu_hpn(pod) and pod.node_name and not pod.terminated:
                present.setdefault(pod.node_name, []).append(
                    PresentPod(pod=pod.ref, uid=pod.metadata.uid or "")
                )
        nodes = set(present)
        if self._registered_nodes is not None:
            nodes.update(self._registered_nodes())
        for node in sorted(nodes):
            try:
                events = await self._submit(
                    ReconcilePods(node=node, present=tuple(present.get(node, ())))
                )
            except Exception:
                log.exception("node %s: reconciling its pods failed", node)
                continue
            if any(isinstance(e, PodRemoved) for e in events) and self._node_pods_changed:
                await self._node_pods_changed(node)

    async def retry(self, ref: PodRef) -> None:
        """Submit the cluster's pod ``ref`` again (its name's earlier pod is now released)."""
        if not self._pods.synced.is_set():
            return
        pod = self._pods.get(ref)
        if pod is None or not is_gpu_hpn(pod):
            return
        self._seen.pop(pod.metadata.uid or str(pod.ref), None)
        await self._follow_share_pod(Change(type="ADDED", object=pod))

    async def on_change(self, change: PodChange, before: Pod | None) -> None:
        pod = change.object
        after = None if change.type == "DELETED" else pod
        touched: set[str] = set()
        if _exclusive_placement(before) != _exclusive_placement(after):
            touched.update(p.node_name for p in (before, after) if p is not None and p.node_name)
        if is_gpu_hpn(pod) and await self._follow_share_pod(change):
            touched.add(pod.node_name)
        if self._node_pods_changed is not None:
            for node in sorted(touched):
                await self._node_pods_changed(node)

    async def _follow_share_pod(self, change: PodChange) -> bool:
        """Register or remove the pod; True when the core removed it from its node."""
        pod = change.object
        key = pod.metadata.uid or str(pod.ref)
        if change.type == "DELETED" or pod.terminated:
            if not pod.node_name or self._seen.get(key) == "removed":
                return False
            events = await self._submit(RemovePod(pod=pod.ref, node=pod.node_name))
            if change.type == "DELETED":
                self._seen.pop(key, None)
            else:
                self._seen[key] = "removed"
            return any(isinstance(e, PodRemoved) for e in events)
        if not pod.node_name:
            return False
        manifest = pod_manifest(pod)
        if self._seen.get(key) == manifest:
            return False
        events = await self._submit(RegisterPod(manifest=manifest))
        self._seen[key] = manifest
        for event in events:
            if isinstance(event, PodRejected):
                await self._report(pod, event)
        return False

    async def _report(self, pod: Pod, rejection: PodRejected) -> None:
        await self._api.create_event(
            PodEvent(
                name=pod_event_name(
                    pod.metadata.name, pod.metadata.uid, rejection.reason, rejection.message
                ),
                pod=pod.ref,
                pod_uid=pod.metadata.uid,
                type="Warning",
                reason=rejection.reason,
                message=rejection.message,
                time=kube_time(self._clock()),
            )
        )


def _exclusive_placement(pod: Pod | None) -> tuple[str, bool] | None:
    if pod is None or not pod.node_name:
        return None
    return (pod.node_name, asks_exclusive_gpu(pod) and not pod.terminated)
