"""The extender's view of the cluster: nodes and pods, kept by list+watch."""

from __future__ import annotations

import asyncio
import logging

from gpupool.core.fragmentation import Task, Workload, fragmentation
from gpupool.events import PodRef, Share
from gpupool.extender.rules import (
    Cost,
    GpuSharePod,
    InvalidGpuSharePod,
    NodeModel,
    PodView,
    node_gpu_choice,
    node_model,
    placement_cost,
    pod_view,
)
from gpupool.kube.pod_directory import PodDirectory, share_requests
from gpupool.kube.port import KubernetesApi
from gpupool.kube.records import Node, ObjectMeta, Pod, PodChange, Synced

log = logging.getLogger(__name__)


WORKLOAD_DRIFT = 32
"""The workload is refolded once the pods changed since the last fold reach 1/32 of
the pods it was folded from (or a kind of pod it has not seen appears): scores stay
cached in between (docs/placement.md)."""


class _NodeCosts:
    """What scoring a node remembers while its model and the workload stay the same."""

    def __init__(self, model: NodeModel, before: float) -> None:
        self.model = model
        self.before = before
        self.costs: dict[Task, Cost] = {}
        self._gpus: dict[Share, int | None] = {}

    def choose(self, model: NodeModel, want: Share) -> int | None:
        """``node_gpu_choice``, once per share asked (pods of one share, other CPU alike)."""
        if want not in self._gpus:
            self._gpus[want] = node_gpu_choice(model, want)
        return self._gpus[want]


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
        self._costs: dict[str, _NodeCosts] = {}
        """Per node: its model, its fragmentation and the costs of the tasks scored there,
        for the current workload (dropped with the model, all dropped with the workload)."""
        self._changes = 0
        """Pods counted into or out of ``_tasks`` since the workload was last folded."""
        self._folded_from = 0
        self._share: dict[str, dict[PodRef, Share]] = {}
        """Per node: the share requests of the live GPU-sharing pods bound there."""

    def workload(self) -> Workload:
        """The distribution of the pods the cluster runs and waits for (folded from the watch).

        Refolded only when it has drifted (``WORKLOAD_DRIFT``): each refold drops every
        cached cost."""
        if self._workload is None or self._changes * WORKLOAD_DRIFT >= max(1, self._folded_from):
            live = {task: n for task, n in self._tasks.items() if n > 0}
            self._workload = Workload.of(live)
            self._folded_from = sum(live.values())
            self._changes = 0
            self._costs.clear()
        return self._workload

    def cost(self, node: Node, task: Task) -> Cost:
        """``placement_cost`` of ``task`` on the model of ``node`` for ``workload()``,
        remembered until the node's model or the workload changes."""
        workload = self.workload()
        model = self.model(node)
        kept = self._costs.get(node.name)
        if kept is None or kept.model is not model:
            kept = self._costs[node.name] = _NodeCosts(model, fragmentation(model.free, workload))
        found = kept.costs.get(task)
        if found is None:
            found = kept.costs[task] = placement_cost(
                model, task, workload, before=kept.before, choose=kept.choose
            )[0]
        return found

    def share_usage(self, node: str, *, excluding: PodRef | None = None) -> Share:
        """Sum of the GPU-share requests of the live pods bound to ``node`` (kept up to date
        from the watch; the same sum as ``PodDirectory.share_usage``)."""
        core = memory = 0
        for ref, requests in self._share.get(node, {}).items():
            if ref != excluding:
                core += requests.core
                memory += requests.memory
        return Share(core=core, memory=memory)

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
        deltas: dict[Task, int] = {}
        for pod, step in ((before, -1), (after, 1)):
            if pod is None:
                continue
            if pod.node_name:
                self._models.pop(pod.node_name, None)
                self._share.get(pod.node_name, {}).pop(pod.ref, None)
            self._views.pop(pod.ref, None)
            kind, task = (None, None) if pod.terminated else self._view(pod)
            if task is not None:
                deltas[task] = deltas.get(task, 0) + step
            if step > 0 and pod.node_name and isinstance(kind, GpuSharePod | InvalidGpuSharePod):
                self._share.setdefault(pod.node_name, {})[pod.ref] = share_requests(pod)
        if after is None and before is not None:
            self._views.pop(before.ref, None)
        for task, step in deltas.items():  # an update that keeps the pod's kind changes nothing
            if step == 0:
                continue
            seen = self._tasks.get(task, 0)
            self._tasks[task] = seen + step
            self._changes += abs(step)
            if self._workload is not None and step > 0 and seen == 0:
                self._workload = None  # a kind of pod the workload has not seen

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
