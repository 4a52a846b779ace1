"""Commands whose names or numbers the log could not hold are refused before deciding.

``decide`` calls :func:`refuse_node_config` / :func:`refuse_pod_manifest` first: a node name that is no
Kubernetes node name (a space, ``*``, ``>``, 100,000 characters) cannot be a log
subject token, and a pod name, uid or priority past the event model's limits would be
written but refused when read back. Each becomes a specific rejection, recorded on no
node (``NODELESS``) when the node name itself is what is wrong, so the service that
submitted it records it and goes on.
"""

from __future__ import annotations

from gpupool.core.validation import (
    PodManifest,
    pod_name_problem,
    shortened_pod_ref,
    validate_node_name,
)
from gpupool.events import NODELESS, Event, NodeRejected, PodRef, PodRejected
from gpupool.events.limits import MAX_GPUS_PER_NODE, MAX_PRIORITY, MAX_TEXT, MIN_PRIORITY


def refuse_node_config(node: str, gpu_count: int) -> list[Event] | None:
    """The rejection of a node configuration the log cannot hold; None if it can."""
    bad_node = validate_node_name(node)
    if bad_node is not None:
        return [NodeRejected(node=NODELESS, reason=bad_node.reason, message=bad_node.message)]
    if not 0 <= gpu_count <= MAX_GPUS_PER_NODE:
        message = (
            f"node {node} advertises {gpu_count} GPUs; gpupool manages 0 to {MAX_GPUS_PER_NODE}"
        )
        return [NodeRejected(node=node, reason="InvalidGpuCount", message=message)]
    return None


def _rejected_pod(manifest: PodManifest, node: str, *, reason: str, message: str) -> list[Event]:
    """The pod as the log can hold it, rejected (made only for a rejection: most pods have
    none)."""
    namespace, name = shortened_pod_ref(manifest.namespace, manifest.name)
    namespace = namespace.encode(errors="replace").decode()
    name = name.encode(errors="replace").decode()
    ref = PodRef(namespace=namespace, name=name)
    return [PodRejected(pod=ref, node=node, reason=reason, message=message)]


def refuse_pod_manifest(manifest: PodManifest) -> list[Event] | None:
    """The rejection of a pod whose names or numbers the log cannot hold; None if it can."""
    bad_node = validate_node_name(manifest.node)
    if bad_node is not None:
        return _rejected_pod(manifest, NODELESS, reason=bad_node.reason, message=bad_node.message)
    node = manifest.node
    problem = pod_name_problem(manifest.namespace, manifest.name, manifest.uid)
    if problem is not None:
        return _rejected_pod(manifest, node, reason="InvalidPodName", message=problem)
    if len(manifest.uid) > MAX_TEXT:
        message = f"pod uid of {len(manifest.uid)} characters; at most {MAX_TEXT}"
        return _rejected_pod(manifest, node, reason="InvalidPodUid", message=message)
    if not MIN_PRIORITY <= manifest.priority <= MAX_PRIORITY:
        message = (
            f"priority {manifest.priority} is outside the int32 range of Kubernetes "
            f"priorities ({MIN_PRIORITY}..{MAX_PRIORITY})"
        )
        return _rejected_pod(manifest, node, reason="InvalidPriority", message=message)
    return None


def command_node_or_nodeless(node: str) -> str:
    """The node a command's events are recorded on: ``NODELESS`` for a name no node can have."""
    return node if validate_node_name(node) is None else NODELESS
