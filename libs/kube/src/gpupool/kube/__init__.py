"""Kubernetes mode: the ``KubernetesApi`` port and its kubernetes-asyncio adapter, the node and
pod controllers the policy service runs, the node status gpupool writes, and the pod cache.

Nothing outside this package imports kubernetes_asyncio.
"""

from gpupool.kube.controllers import KubernetesControllers
from gpupool.kube.node_controller import NodeController
from gpupool.kube.node_status import (
    ConfigurationRefused,
    NodeOutcome,
    NodeShareState,
    NodeStatusSettings,
    OriginalResources,
    SharingDisabled,
    SharingEnabled,
    is_applied,
    original_resources,
    read_share_state,
    status_patch,
)
from gpupool.kube.pod_controller import PodController
from gpupool.kube.pod_directory import PodDirectory
from gpupool.kube.port import KubernetesApi, KubernetesApiError, SubmitCommand
from gpupool.kube.preemption_recorder import PreemptionRecorder
from gpupool.kube.records import (
    Change,
    Node,
    NodeChange,
    NodeCondition,
    NodeStatusPatch,
    Pod,
    PodChange,
    PodCondition,
    PodEvent,
    Synced,
)

__all__ = [
    "Change",
    "ConfigurationRefused",
    "KubernetesApi",
    "KubernetesApiError",
    "KubernetesControllers",
    "Node",
    "NodeChange",
    "NodeCondition",
    "NodeController",
    "NodeOutcome",
    "NodeShareState",
    "NodeStatusPatch",
    "NodeStatusSettings",
    "OriginalResources",
    "Pod",
    "PodChange",
    "PodCondition",
    "PodController",
    "PodDirectory",
    "PodEvent",
    "PreemptionRecorder",
    "SharingDisabled",
    "SharingEnabled",
    "SubmitCommand",
    "Synced",
    "is_applied",
    "original_resources",
    "read_share_state",
    "status_patch",
]
