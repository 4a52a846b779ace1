"""Nodes labelled ``alibabacloud.com/gpu-share-policy``: configure them in the core, show the result.

On every change of such a node (or of the whole-GPU pods bound to it) the
controller submits ``ConfigureNode`` with the label, the QoS annotation, the GPU
count and the exclusive-GPU pods on it, then patches the node's status from the
result (:mod:`gpupool.kube.node_status`). A command equal to the last one is not
submitted again (kubelet touches nodes every few seconds), except to retry a
refused configuration when pods on the node changed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import UTC, datetime

from gpupool.core import ConfigureNode, Rejection, parse_qos_annotation, validate_node_policy
from gpupool.core.validation import POLICY_LABEL, QOS_ANNOTATION
from gpupool.events import Event, NodeConfigured, NodeDisabled, NodeRejected
from gpupool.kube.node_status import (
    ORIGINAL_ALLOCATABLE_ANNOTATION,
    POLICY_CONDITION,
    ConfigurationRefused,
    NodeOutcome,
    NodeStatusSettings,
    SharingDisabled,
    SharingEnabled,
    gpu_count,
    is_applied,
    original_allocatable_annotation,
    original_resources,
    status_patch,
)
from gpupool.kube.pod_directory import PodDirectory
from gpupool.kube.port import KubernetesApi, KubernetesApiError, SubmitCommand
from gpupool.kube.records import Node, NodeChange, Synced

log = logging.getLogger(__name__)


def utc_now() -> datetime:
    return datetime.now(UTC)


def is_managed(node: Node) -> bool:
    """Labelled for GPU sharing, or carrying gpupool's conditions (the label was removed)."""
    return POLICY_LABEL in node.metadata.labels or node.condition(POLICY_CONDITION) is not None


def configure_command(
    node: Node, pods: PodDirectory, *, default_qos: str | None = None
) -> ConfigureNode:
    """The node as the core sees it. ``default_qos`` (the operator's, in the annotation's
    format) stands in for a QoS annotation the node does not carry."""
    return ConfigureNode(
        node=node.name,
        policy_label=node.metadata.labels.get(POLICY_LABEL),
        qos_annotation=node.metadata.annotations.get(QOS_ANNOTATION, default_qos),
        gpu_count=gpu_count(node),
        exclusive_gpu_pods=pods.exclusive_gpu_pods(node.name),
    )


def outcome_of(command: ConfigureNode, events: list[Event]) -> NodeOutcome:
    """What is in force after ``command``: from its events, or (none: nothing changed) its inputs."""
    for event in reversed(events):
        match event:
            case NodeConfigured():
                return SharingEnabled(
                    policy=event.policy,
                    reserved_ephemeral_storage=event.qos.reserved_ephemeral_storage,
                )
            case NodeDisabled():
                return SharingDisabled(reserved_ephemeral_storage=_reserved_storage(command))
            case NodeRejected():
                return ConfigurationRefused(reason=event.reason, message=event.message)
    policy = validate_node_policy(command.policy_label)
    if isinstance(policy, Rejection):
        return ConfigurationRefused(reason=policy.reason, message=policy.message)
    if policy is None:
        return SharingDisabled(reserved_ephemeral_storage=_reserved_storage(command))
    return SharingEnabled(policy=policy, reserved_ephemeral_storage=_reserved_storage(command))


def _reserved_storage(command: ConfigureNode) -> str | None:
    qos = parse_qos_annotation(command.qos_annotation)
    return None if isinstance(qos, Rejection) else qos.reserved_ephemeral_storage


class NodeController:
    def __init__(
        self,
        api: KubernetesApi,
        submit: SubmitCommand,
        pods: PodDirectory,
        *,
        settings: NodeStatusSettings | None = None,
        clock: Callable[[], datetime] = utc_now,
        default_qos: str | None = None,
    ) -> None:
        self._api = api
        self._submit = submit
        self._pods = pods
        self._default_qos = default_qos
        self._settings = settings or NodeStatusSettings()
        self._clock = clock
        self._nodes: dict[str, Node] = {}
        self._last: dict[str, tuple[ConfigureNode, NodeOutcome]] = {}
        self._lock = asyncio.Lock()
        self.synced = asyncio.Event()
        """Set once every node of the first list has been reconciled."""

    async def run(self) -> None:
        """Follow the node watch forever."""
        async for item in self._api.watch_nodes():
            if isinstance(item, Synced):
                self.synced.set()
                continue
            try:
                await self.on_change(item)
            except Exception:
                log.exception("node %s: reconciling failed", item.object.name)

    async def on_change(self, change: NodeChange) -> None:
        name = change.object.name
        if change.type == "DELETED":
            self._nodes.pop(name, None)
            self._last.pop(name, None)
            return
        self._nodes[name] = change.object
        await self.reconcile(name)

    async def pods_changed(self, name: str) -> None:
        """Whole-GPU or GPU-sharing pods on the node changed: a refused configuration may pass now."""
        if self._pods.synced.is_set():
            await self.reconcile(name, retry_refused=True)

    def outcome(self, name: str) -> NodeOutcome | None:
        """The last outcome for the node (None before its first reconcile)."""
        last = self._last.get(name)
        return last[1] if last is not None else None

    async def reconcile(self, name: str, *, retry_refused: bool = False) -> None:
        await self._pods.synced.wait()
        async with self._lock:
            node = self._nodes.get(name)
            if node is None or not is_managed(node):
                return
            command = configure_command(node, self._pods, default_qos=self._default_qos)
            last = self._last.get(name)
            if (
                last is not None
                and last[0] == command
                and not (retry_refused and isinstance(last[1], ConfigurationRefused))
            ):
                outcome = last[1]
            else:
                outcome = outcome_of(command, await self._submit(command))
                self._last[name] = (command, outcome)
            await self._show(node, outcome, command.gpu_count)

    async def _show(self, node: Node, outcome: NodeOutcome, gpus: int) -> None:
        now = self._clock()
        original = original_resources(node)
        patch = status_patch(
            original,
            outcome,
            gpus=gpus,
            current=node.status.conditions,
            settings=self._settings,
            now=now,
        )
        if is_applied(node.status, patch, settings=self._settings, now=now):
            return
        try:
            if (
                not isinstance(outcome, ConfigurationRefused)
                and ORIGINAL_ALLOCATABLE_ANNOTATION not in node.metadata.annotations
            ):
                await self._api.patch_node_annotations(
                    node.name,
                    {ORIGINAL_ALLOCATABLE_ANNOTATION: original_allocatable_annotation(original)},
                )
            await self._api.patch_node_status(node.name, patch)
        except KubernetesApiError as exc:
            if exc.status != 404:
                raise
            log.info("node %s is gone; its status was not patched", node.name)
