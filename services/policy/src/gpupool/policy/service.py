"""The policy service: validates and registers nodes and pods.

Local mode reads them from a cluster file (``--cluster FILE``); Kubernetes mode
(``--kubernetes``) watches the API through gpupool.kube. Either way every
decision is the core's (ConfigureNode, RegisterPod, RemovePod) and every
rejection is an event.
"""

from __future__ import annotations

import logging
from contextlib import AsyncExitStack

from gpupool.core import Command, ConfigureNode, RegisterPod, RemovePod
from gpupool.eventlog.port import StoredEvent
from gpupool.events import Event, NodeRejected, PodRejected
from gpupool.policy.local_config import LocalCluster, node_commands, pod_commands
from gpupool.runtime.decider import DeciderLoop

log = logging.getLogger(__name__)


def command_node(command: Command) -> str:
    if isinstance(command, RegisterPod):
        return command.manifest.node
    if isinstance(command, ConfigureNode | RemovePod):
        return command.node
    raise TypeError(f"the policy service does not send {type(command).__name__}")


class PolicyService:
    name = "policy"

    def __init__(self, cluster: LocalCluster | None) -> None:
        self.cluster = cluster
        self._loop: DeciderLoop | None = None

    async def submit(self, command: Command) -> list[Event]:
        assert self._loop is not None
        events = await self._loop.execute(command, node=command_node(command))
        for event in events:
            if isinstance(event, PodRejected | NodeRejected):
                log.warning("policy: rejected %s: %s", event.reason, event.message)
        return events

    async def start(self, loop: DeciderLoop, stack: AsyncExitStack) -> None:
        self._loop = loop
        if self.cluster is not None:
            for command in [*node_commands(self.cluster), *pod_commands(self.cluster)]:
                await self.submit(command)

    async def react(self, entry: StoredEvent) -> None:
        return None
