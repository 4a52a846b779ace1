"""Kubernetes mode of the policy service, wired: one pod directory, the node and pod controllers.

    controllers = KubernetesControllers(api, submit)
    await controllers.run()          # both watches, until cancelled

``controllers.pods`` is the pod watch cache (``by_uid`` for the node-executor's
workload identity); ``controllers.preemptions`` records Preempted events.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from datetime import datetime

from gpupool.core import Command
from gpupool.events import Event
from gpupool.kube.node_controller import NodeController, utc_now
from gpupool.kube.node_status import NodeStatusSettings
from gpupool.kube.pod_controller import PodController
from gpupool.kube.pod_directory import PodDirectory
from gpupool.kube.port import KubernetesApi, SubmitCommand
from gpupool.kube.preemption_recorder import PreemptionRecorder


class KubernetesControllers:
    def __init__(
        self,
        api: KubernetesApi,
        submit: SubmitCommand,
        *,
        settings: NodeStatusSettings | None = None,
        clock: Callable[[], datetime] = utc_now,
        registered_nodes: Callable[[], Iterable[str]] | None = None,
        default_qos: str | None = None,
    ) -> None:
        self._submit = submit
        self._submitting = asyncio.Lock()
        self.pods = PodDirectory()
        self.nodes = NodeController(
            api, self.submit, self.pods, settings=settings, clock=clock, default_qos=default_qos
        )
        self.pod_controller = PodController(
            api,
            self.submit,
            self.pods,
            node_pods_changed=self.nodes.pods_changed,
            nodes_ready=self.nodes.synced.wait,
            registered_nodes=registered_nodes,
            clock=clock,
        )
        self.preemptions = PreemptionRecorder(api, self.pods)

    async def submit(self, command: Command) -> list[Event]:
        """One command at a time: the node and pod watches run side by side."""
        async with self._submitting:
            return await self._submit(command)

    async def run(self) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(self.pod_controller.run(), name="gpupool-pod-watch")
            group.create_task(self.nodes.run(), name="gpupool-node-watch")
