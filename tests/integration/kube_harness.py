"""Shared parts of the Kubernetes tests: kmock as the API server, the real core behind ``submit``.

kmock (a real HTTP server speaking the Kubernetes REST protocol, in-process)
stands in for kube-apiserver; gpupool talks to it through the real
kubernetes-asyncio adapter. The test acts like kubectl, over HTTP too.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from datetime import UTC, datetime, timedelta
from typing import Any

import kmock as kmock_lib

from gpupool.core import Command, State, apply, decide
from gpupool.events import Event
from gpupool.kube.adapter import KubernetesAsyncioApi
from gpupool.kube.controllers import KubernetesControllers
from gpupool.kube.listwatch import WatchSettings
from gpupool.kube.node_status import NodeStatusSettings
from gpupool.kube.records import (
    NodeChange,
    NodeStatusPatch,
    PodChange,
    PodCondition,
    PodEvent,
    Synced,
)

T0 = datetime(2025, 1, 7, 4, 13, 4, tzinfo=UTC)

SOURCE_NODE = "cn-wulanchabu-c.cr-xxx"
SOURCE_RESOURCES = {
    "cpu": "176",
    "memory": "1800Gi",
    "nvidia.com/gpu": "16",
    "ephemeral-storage": "6Ti",
}
SOURCE_QOS = (
    '{"preemptEnabled": true, "podMaxDurationMinutes": 120, "reservedEphemeralStorage": "1.5Ti"}'
)
POLICY_LABEL = "alibabacloud.com/gpu-share-policy"
QOS_ANNOTATION = "alibabacloud.com/gpu-share-qos-config"

FAST_WATCH = WatchSettings(initial_backoff_seconds=0.01, max_backoff_seconds=0.05)


class ManualClock:
    """The time the controllers see; tests move it."""

    def __init__(self, start: datetime = T0) -> None:
        self.now = start

    def __call__(self) -> datetime:
        return self.now

    def advance(self, **delta: float) -> None:
        self.now += timedelta(**delta)


class Activity:
    """Announced after every write gpupool makes and every command it submits: tests wait on it."""

    def __init__(self) -> None:
        self._changed = asyncio.Condition()

    async def announce(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def until(self, predicate: Callable[[], bool], within: float = 10.0) -> None:
        """Wait until ``predicate()`` holds, re-checking after each announcement."""
        async with asyncio.timeout(within), self._changed:
            await self._changed.wait_for(predicate)


class CoreSubmitter:
    """What the policy service passes as ``submit``: the real core's decide, then evolve."""

    def __init__(self, clock: Callable[[], datetime], activity: Activity) -> None:
        self.state = State()
        self.events: list[Event] = []
        self.commands: list[Command] = []
        self._clock = clock
        self._activity = activity

    async def __call__(self, command: Command) -> list[Event]:
        now = self._clock()
        events = decide(self.state, command, now)
        apply(self.state, events, now)
        self.commands.append(command)
        self.events.extend(events)
        await self._activity.announce()
        return events


class ObservedApi:
    """The real adapter, announcing each completed write."""

    def __init__(self, api: KubernetesAsyncioApi, activity: Activity) -> None:
        self.api = api
        self._activity = activity
        self.seen: set[str] = set()
        """Names (nodes) and namespace/names (pods) the watches delivered."""

    async def watch_nodes(self) -> AsyncIterator[NodeChange | Synced]:
        async for item in self.api.watch_nodes():
            if not isinstance(item, Synced):
                self.seen.add(item.object.name)
            yield item
            await self._announce()

    async def watch_pods(self) -> AsyncIterator[PodChange | Synced]:
        async for item in self.api.watch_pods():
            if not isinstance(item, Synced):
                self.seen.add(str(item.object.ref))
            yield item
            await self._announce()

    async def patch_node_status(self, name: str, patch: NodeStatusPatch) -> None:
        try:
            await self.api.patch_node_status(name, patch)
        finally:
            await self._announce()

    async def patch_node_annotations(self, name: str, annotations: dict[str, str | None]) -> None:
        try:
            await self.api.patch_node_annotations(name, annotations)
        finally:
            await self._announce()

    async def create_event(self, event: PodEvent) -> None:
        try:
            await self.api.create_event(event)
        finally:
            await self._announce()

    async def patch_pod_condition(self, namespace: str, name: str, condition: PodCondition) -> None:
        try:
            await self.api.patch_pod_condition(namespace, name, condition)
        finally:
            await self._announce()

    async def _announce(self) -> None:
        await self._activity.announce()


def declare_resources(server: kmock_lib.KubernetesEmulator) -> None:
    for resource in ("v1/nodes", "v1/pods", "v1/events"):
        server.resources[resource] = {}


async def connect(server: kmock_lib.KubernetesEmulator) -> KubernetesAsyncioApi:
    return await KubernetesAsyncioApi.connect(host=str(server.url), watch_settings=FAST_WATCH)


@contextlib.asynccontextmanager
async def running(work: Coroutine[Any, Any, None]) -> AsyncIterator[asyncio.Task[None]]:
    """Run ``work`` in the background for the block; a failure in it fails the test."""
    task = asyncio.create_task(work)
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# --------------------------------------------------------------------------- kubectl


async def kubectl(
    server: kmock_lib.KubernetesEmulator, method: str, path: str, body: Any = None
) -> Any:
    headers = {"Content-Type": "application/merge-patch+json"} if method == "PATCH" else {}
    response = await server.request(method, path, json=body, headers=headers)
    async with response:
        assert response.status < 300, await response.text()
        return await response.json()


def node_object(
    name: str = SOURCE_NODE,
    *,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    resources: dict[str, str] | None = None,
) -> dict[str, Any]:
    have = dict(SOURCE_RESOURCES if resources is None else resources)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels or {}, "annotations": annotations or {}},
        "status": {"capacity": dict(have), "allocatable": dict(have)},
    }


def pod_object(
    name: str,
    *,
    node: str = "",
    namespace: str = "default",
    uid: str | None = None,
    labels: dict[str, str] | None = None,
    requests: dict[str, str] | None = None,
    limits: dict[str, str] | None = None,
    priority: int | None = None,
    phase: str = "Running",
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [
            {
                "name": "demo",
                "image": "registry-cn-wulanchabu-vpc.ack.aliyuncs.com/acs/stress:v1.0.4",
                "resources": {"requests": requests or {}, "limits": limits or {}},
            }
        ]
    }
    if node:
        spec["nodeName"] = node
    if priority is not None:
        spec["priority"] = priority
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid or f"uid-{namespace}-{name}",
            "labels": labels or {},
        },
        "spec": spec,
        "status": {"phase": phase},
    }


def share_pod(
    name: str,
    node: str = SOURCE_NODE,
    *,
    policy: str = "share-pool",
    request: int = 10,
    limit: int = 100,
    **extra: Any,
) -> dict[str, Any]:
    """The documented gpu-share-demo pod (requests 10 / limits 100 by default)."""
    return pod_object(
        name,
        node=node,
        labels={"alibabacloud.com/compute-class": "gpu-hpn", POLICY_LABEL: policy},
        requests={
            "cpu": "5",
            "memory": "50Gi",
            "alibabacloud.com/gpu-core.percentage": str(request),
            "alibabacloud.com/gpu-memory.percentage": str(request),
        },
        limits={
            "cpu": "5",
            "memory": "50Gi",
            "alibabacloud.com/gpu-core.percentage": str(limit),
            "alibabacloud.com/gpu-memory.percentage": str(limit),
        },
        **extra,
    )


def exclusive_pod(
    name: str, node: str = SOURCE_NODE, *, gpus: int = 1, **extra: Any
) -> dict[str, Any]:
    return pod_object(
        name,
        node=node,
        requests={"nvidia.com/gpu": str(gpus)},
        limits={"nvidia.com/gpu": str(gpus)},
        **extra,
    )


class PolicyInKubernetesMode:
    """The controllers the policy service runs, over the real adapter, with the real core."""

    def __init__(
        self,
        server: kmock_lib.KubernetesEmulator,
        adapter: KubernetesAsyncioApi,
        settings: NodeStatusSettings | None = None,
        logged: list[Event] | None = None,
    ) -> None:
        self.server = server
        self.activity = Activity()
        self.clock = ManualClock()
        self.core = CoreSubmitter(self.clock, self.activity)
        if logged:  # what the log held before this (re)start
            apply(self.core.state, logged, self.clock())
        self.api = ObservedApi(adapter, self.activity)
        self.controllers = KubernetesControllers(
            self.api,
            self.core,
            settings=settings,
            clock=self.clock,
            registered_nodes=lambda: {pod.node for pod in self.core.state.pods.values()},
        )

    async def until(self, predicate: Callable[[], bool], within: float = 10.0) -> None:
        await self.activity.until(predicate, within)

    def node(self, name: str = SOURCE_NODE) -> dict[str, Any]:
        found: dict[str, Any] = self.server.objects["v1/nodes", None, name].raw
        return found

    def pod(self, name: str, namespace: str = "default") -> dict[str, Any]:
        found: dict[str, Any] = self.server.objects["v1/pods", namespace, name].raw
        return found

    def events(self, namespace: str = "default") -> list[dict[str, Any]]:
        return [
            obj.raw
            for (resource, ns, _), obj in self.server.objects.items()
            if resource.plural == "events" and ns == namespace and not obj.deleted
        ]


@contextlib.asynccontextmanager
async def policy_in_kubernetes_mode(
    server: kmock_lib.KubernetesEmulator,
    settings: NodeStatusSettings | None = None,
    *,
    logged: list[Event] | None = None,
) -> AsyncIterator[PolicyInKubernetesMode]:
    """Start the controllers against ``server``; objects created before are seen by the first list.

    ``logged``: events the log held before this start (a restarted policy service)."""
    declare_resources(server)
    async with await connect(server) as adapter:
        world = PolicyInKubernetesMode(server, adapter, settings, logged)
        async with running(world.controllers.run()):
            await watches_are_live(world)
            yield world


async def watches_are_live(world: PolicyInKubernetesMode) -> None:
    """Return once changes made from now on reach the controllers.

    kmock has no resourceVersions: a watch opened after a change starts from the
    objects as they are, so a deletion made between the list and the watch would
    be missed (a real API server replays it from the list's resourceVersion).
    A probe node and pod, created after both lists and seen through both
    watches, prove the watches are open. Nothing gpupool manages: no label, no node.
    """
    await world.until(lambda: world.controllers.nodes.synced.is_set())
    await kubectl(world.server, "POST", "/api/v1/nodes", {"metadata": {"name": "watch-probe"}})
    await kubectl(
        world.server,
        "POST",
        "/api/v1/namespaces/gpupool-probe/pods",
        {"metadata": {"name": "watch-probe", "namespace": "gpupool-probe"}, "spec": {}},
    )
    await world.until(lambda: {"watch-probe", "gpupool-probe/watch-probe"} <= world.api.seen)
