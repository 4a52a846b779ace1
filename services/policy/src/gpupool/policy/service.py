"""The policy service: validates and registers nodes and pods.

Local mode reads them from a cluster file (``--cluster FILE``) and reads it again
whenever it changes (new pods are registered, changed nodes configured again;
``gpupool pod add`` writes it); Kubernetes mode
(``--kubernetes``) watches the API through gpupool.kube: node labels and QoS
annotations become ConfigureNode (and the node's status is patched), GPU-sharing
pods become RegisterPod / RemovePod, rejections become Kubernetes Events, and every
``Preempted`` in the log is recorded on both pods (events and the
``Interruption.GPUShareReclaim`` condition). Every decision is the core's and
every rejection is an event in the log.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack, suppress
from pathlib import Path

from gpupool.core import (
    Command,
    ConfigureNode,
    PresentPod,
    ReconcilePods,
    RegisterPod,
    RemovePod,
    State,
    decide,
)
from gpupool.core.input_bounds import command_node_or_nodeless
from gpupool.core.simulation import pod_manifest
from gpupool.eventlog.port import StoredEvent
from gpupool.events import Envelope, Event, NodeRejected, PodRef, PodRejected, Preempted, Released
from gpupool.kube.adapter import KubernetesAsyncioApi
from gpupool.kube.controllers import KubernetesControllers
from gpupool.policy.local_config import (
    ConfigError,
    LocalCluster,
    load_local_cluster,
    node_commands,
    pod_commands,
)
from gpupool.policy.rejections import RecordedRejections
from gpupool.runtime.decider import DeciderLoop
from gpupool.runtime.projection import Projection

log = logging.getLogger(__name__)

RECENT_PREEMPTIONS = 1000
"""Preemptions seen while rebuilding that are recorded again at start (idempotently: the
Kubernetes event names derive from the log entry ids), so none is lost to a crash between
the log and the API server."""

CLUSTER_FILE_CHECK_S = 1.0
"""How often local mode looks at the cluster file's modification time."""


def command_node(command: Command) -> str:
    """The node the command's events are recorded on (none for a name no node can have)."""
    if isinstance(command, RegisterPod):
        return command_node_or_nodeless(command.manifest.node)
    if isinstance(command, ConfigureNode | RemovePod | ReconcilePods):
        return command_node_or_nodeless(command.node)
    raise TypeError(f"the policy service does not send {type(command).__name__}")


class PolicyService:
    name = "policy"

    def __init__(
        self,
        cluster: LocalCluster | None,
        *,
        kubernetes: Callable[[], Awaitable[KubernetesAsyncioApi]] | None = None,
        cluster_file: Path | None = None,
        default_qos: str | None = None,
    ) -> None:
        self.cluster = cluster
        self.default_qos = default_qos
        """In Kubernetes mode: the QoS of a node without the QoS annotation (its format)."""
        self.cluster_file = cluster_file
        self._connect_kubernetes = kubernetes
        self._loop: DeciderLoop | None = None
        self.controllers: KubernetesControllers | None = None
        self._recent_preemptions: deque[Envelope] = deque(maxlen=RECENT_PREEMPTIONS)
        self.rejections = RecordedRejections()

    def projection(self) -> Projection:
        """The projection to rebuild into: it remembers recent preemptions to re-record."""
        return Projection(observers=[self._observe])

    def _observe(self, _: State, envelope: Envelope, __: int) -> None:
        if isinstance(envelope.event, Preempted):
            self._recent_preemptions.append(envelope)
        self.rejections.observe(envelope)

    async def submit(self, command: Command) -> list[Event]:
        assert self._loop is not None
        if isinstance(command, RegisterPod | ConfigureNode):
            # a pod or node the log already holds the same rejection for: not recorded again
            # (every start submits the whole cluster again)
            planned = decide(self._loop.projection.state, command, self._loop.clock())
            if self.rejections.already_recorded(planned):
                return planned
        events = await self._loop.execute(command, node=command_node(command))
        for event in events:
            if isinstance(event, PodRejected | NodeRejected):
                log.warning("policy: rejected %s: %s", event.reason, event.message)
        return events

    async def start(self, loop: DeciderLoop, stack: AsyncExitStack) -> None:
        self._loop = loop
        if self.cluster is not None:
            # nodes first, then what the log holds and the file no longer names is removed,
            # then the file's pods are registered
            commands: list[Command] = [
                *node_commands(self.cluster),
                *self._reconcile_with_file(self.cluster),
                *pod_commands(self.cluster),
            ]
            for command in commands:
                await self.submit(command)
            if self.cluster_file is not None:
                watcher = loop.background(
                    self._follow_cluster_file(self.cluster_file, self.cluster),
                    name="cluster-file",
                )

                async def stop_following() -> None:
                    watcher.cancel()
                    with suppress(asyncio.CancelledError):
                        await watcher

                stack.push_async_callback(stop_following)
        if self._connect_kubernetes is not None:
            api = await self._connect_kubernetes()
            stack.push_async_callback(api.close)
            self.controllers = KubernetesControllers(
                api,
                self.submit,
                registered_nodes=self._registered_nodes,
                default_qos=self.default_qos,
            )
            for envelope in list(self._recent_preemptions):
                await self.controllers.preemptions.on_envelope(envelope)
            assert self._loop is not None
            watching = self._loop.background(self.controllers.run(), name="kubernetes-watches")

            async def stop_watching() -> None:
                watching.cancel()
                with suppress(asyncio.CancelledError):
                    await watching

            stack.push_async_callback(stop_watching)

    async def _follow_cluster_file(self, path: Path, loaded: LocalCluster) -> None:
        """Read the cluster file again when it changes; submit what is new in it."""

        def stamp() -> tuple[int, int] | None:
            try:
                info = path.stat()
            except OSError:
                return None
            return (info.st_mtime_ns, info.st_size)

        # not stamped now: the file may have changed since it was loaded, so the first look
        # always reads it again (what it already held is not submitted twice)
        seen: tuple[int, int] | None = None
        nodes = {command.node: command for command in node_commands(loaded)}
        pods = {(pod.namespace, pod.name) for pod in loaded.pods}
        while True:
            await asyncio.sleep(CLUSTER_FILE_CHECK_S)  # no file-change notification here: look
            now = stamp()
            if now is None or now == seen:
                continue
            seen = now
            try:
                cluster = load_local_cluster(path)
            except ConfigError as error:
                log.warning("policy: the cluster file changed but cannot be used: %s", error)
                continue
            changed: list[Command] = [
                command for command in node_commands(cluster) if nodes.get(command.node) != command
            ]
            new: list[Command] = [
                RegisterPod(manifest=pod_manifest(pod))
                for pod in cluster.pods
                if (pod.namespace, pod.name) not in pods
            ]
            if changed or new:
                log.info(
                    "policy: %s changed: %d node(s) to configure, %d new pod(s)",
                    path,
                    len(changed),
                    len(new),
                )
            for command in [*changed, *new]:
                await self.submit(command)
            nodes.update({c.node: c for c in changed if isinstance(c, ConfigureNode)})
            pods.update((pod.namespace, pod.name) for pod in cluster.pods)

    def _registered_nodes(self) -> list[str]:
        assert self._loop is not None
        state = self._loop.projection.state
        return sorted({pod.node for pod in state.pods.values()})

    def _reconcile_with_file(self, cluster: LocalCluster) -> list[ReconcilePods]:
        present: dict[str, list[PresentPod]] = {}
        for command in pod_commands(cluster):
            assert isinstance(command, RegisterPod)
            manifest = command.manifest
            present.setdefault(manifest.node, []).append(
                PresentPod(
                    pod=PodRef(namespace=manifest.namespace, name=manifest.name), uid=manifest.uid
                )
            )
        nodes = set(present) | set(self._registered_nodes())
        return [
            ReconcilePods(node=node, present=tuple(present.get(node, ()))) for node in sorted(nodes)
        ]

    async def react(self, entry: StoredEvent) -> None:
        event = entry.envelope.event
        if self.controllers is not None and isinstance(event, Preempted):
            await self.controllers.preemptions.on_envelope(entry.envelope)
        if (
            self.controllers is not None
            and isinstance(event, Released)
            and self._loop is not None
            and event.pod not in self._loop.projection.state.pods
        ):
            # a deleted pod's slot is free now: a pod recreated under its name may register
            await self.controllers.pod_controller.retry(event.pod)
