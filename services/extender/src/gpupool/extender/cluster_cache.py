"""The extender's view of the cluster: nodes and pods, kept by list+watch."""

from __future__ import annotations

import asyncio
import logging

from gpupool.core.fragmentation import Task, Workload
from gpupool.events import PodRef
from gpupool.extender.rules import NodeModel, PodView, node_model, pod_view
from gpupool.kube.pod_directory import PodDirectory
from gpupool.kube.port import KubernetesApi
from gpupool.kube.records import Node, ObjectMeta, Pod, PodChange, Synced

log = logging.getLogger(__name__)


class ClusterCache:
    def __init__(self, api: KubernetesApi) -> None:
        self._api = api
        self.nodes: dict[str, Node] = {}
        self.pods = PodDirectory()
        self.nodes_synced = asyncio.Event()
        self._tasks: dict[Task, int] = {}
        """Every live pod the watch has seen, as the fragmentation measure sees it."""
        self._workload: Workload | None = Workload()
        self._views: dict[PodRef, PodView] = {}
        """Each live pod classified once per change (the node models read them)."""
        self._models: dict[str, tuple[Node, NodeModel]] = {}
        """The model of each node scored since its pods or the node last changed."""

    def workload(self) -> Workload:
        """The distribution of the pods the cluster runs and waits for (folded from the watch)."""
        if self._workload is None:
            self._workload = Workload.of({task: n for task, n in self._tasks.items() if n > 0})
        return self._workload

    def model(self, node: Node) -> NodeModel:
        """The extender's model of ``node`` (as the scheduler sent it) with the pods bound there."""
        kept = self._models.get(node.name)
        if kept is not None and kept[0] == node:
            return kept[1]
        bound = [p for p in self.pods.on_node(node.name) if not p.terminated]
        model = node_model(node, bound, self._view)
        self._models[node.name] = (node, model)
        return model

    def _view(self, pod: Pod) -> PodView:
        view = self._views.get(pod.ref)
        if view is None:
            view = self._views[pod.ref] = pod_view(pod)
        return view

    def apply_pod(self, change: PodChange) -> None:
        before = self.pods.apply(change)
        after = None if change.type == "DELETED" else change.object
        for pod, step in ((before, -1), (after, 1)):
            if pod is None:
                continue
            if pod.node_name:
                self._models.pop(pod.node_name, None)
            self._views.pop(pod.ref, None)
            task = None if pod.terminated else self._view(pod)[1]
            if task is not None:
                self._tasks[task] = self._tasks.get(task, 0) + step
                self._workload = None
        if after is None and before is not None:
            self._views.pop(before.ref, None)

    @property
    def ready(self) -> bool:
        """Both first lists are in: filtering on the cache can be trusted."""
        return self.nodes_synced.is_set() and self.pods.synced.is_set()

    async def wait_ready(self) -> None:
        await self.nodes_synced.wait()
        await self.pods.synced.wait()

    def node(self, name: str) -> Node:
        """The cached node, or a bare one (no label, no conditions) if the cache has not seen it."""
        return self.nodes.get(name) or Node(metadata=ObjectMeta(name=name))

    async def run(self) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(self._follow_nodes(), name="extender-node-watch")
            group.create_task(self._follow_pods(), name="extender-pod-watch")

    async def _follow_nodes(self) -> None:
        async for item in self._api.watch_nodes():
            if isinstance(item, Synced):
                self.nodes_synced.set()
            elif item.type == "DELETED":
                self.nodes.pop(item.object.name, None)
            else:
                self.nodes[item.object.name] = item.object

    async def _follow_pods(self) -> None:
        async for item in self._api.watch_pods():
            if isinstance(item, Synced):
                self.pods.synced.set()
            else:
                self.apply_pod(item)
