"""The extender's view of the cluster: nodes and pods, kept by list+watch."""

from __future__ import annotations

import asyncio
import logging

from gpupool.kube.pod_directory import PodDirectory
from gpupool.kube.port import KubernetesApi
from gpupool.kube.records import Node, ObjectMeta, Synced

log = logging.getLogger(__name__)


class ClusterCache:
    def __init__(self, api: KubernetesApi) -> None:
        self._api = api
        self.nodes: dict[str, Node] = {}
        self.pods = PodDirectory()
        self.nodes_synced = asyncio.Event()

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
                self.pods.apply(item)
