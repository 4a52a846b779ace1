"""The two small ports of Kubernetes mode.

``KubernetesApi`` is everything gpupool asks of a cluster: list+watch nodes and
pods, patch a node's status (and one annotation), create an Event, patch a pod
condition. ``KubernetesAsyncioApi`` (:mod:`gpupool.kube.adapter`) implements it
over kubernetes-asyncio; tests run it against kmock.

``SubmitCommand`` is the core's side: the policy service hands the controllers
a function that decides a command against the current state and appends the
resulting events to the log, and returns them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from gpupool.core import Command
from gpupool.events import Event
from gpupool.kube.records import (
    NodeChange,
    NodeStatusPatch,
    PodChange,
    PodCondition,
    PodEvent,
    Synced,
)


class KubernetesApiError(Exception):
    """The API server refused a request (``status`` is the HTTP status, 0 if none came back)."""

    def __init__(self, status: int, reason: str, message: str = "") -> None:
        super().__init__(
            f"HTTP {status} {reason}: {message}" if message else f"HTTP {status} {reason}"
        )
        self.status = status
        self.reason = reason
        self.message = message


class KubernetesApi(Protocol):
    def watch_nodes(self) -> AsyncIterator[NodeChange | Synced]:
        """List, then watch, forever: resumes from the last resourceVersion, re-lists on 410 Gone.

        After every (re-)list it yields ``Synced``; a re-list also yields DELETED for
        objects that vanished meanwhile.
        """
        ...

    def watch_pods(self) -> AsyncIterator[PodChange | Synced]:
        """Pods of all namespaces, with the same guarantees as ``watch_nodes``."""
        ...

    async def patch_node_status(self, name: str, patch: NodeStatusPatch) -> None:
        """Strategic-merge the keys of ``patch`` into ``status`` (None removes a resource)."""
        ...

    async def patch_node_annotations(
        self, name: str, annotations: dict[str, str | None]
    ) -> None: ...

    async def create_event(self, event: PodEvent) -> None:
        """Create a core/v1 Event; one that already exists (same name) is left as it is."""
        ...

    async def patch_pod_condition(self, namespace: str, name: str, condition: PodCondition) -> None:
        """Merge one condition (by type) into the pod's ``status.conditions`` (status subresource)."""
        ...


class SubmitCommand(Protocol):
    async def __call__(self, command: Command) -> list[Event]:
        """Decide ``command`` against the current state, record the events, return them."""
        ...
