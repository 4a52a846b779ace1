"""Local mode: nodes and pods come from a YAML file instead of the Kubernetes API.

The file uses the scenario format's ``nodes`` and ``pods`` sections (docs/scenarios.md);
a ``timeline`` section, if present, is ignored here (``gpupool simulate`` plays it).
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import yaml

from gpupool.core import Command, ConfigureNode, RegisterPod
from gpupool.core.simulation import ScenarioNode, ScenarioPod, pod_manifest


class LocalCluster(msgspec.Struct, frozen=True, kw_only=True):
    nodes: list[ScenarioNode]
    pods: list[ScenarioPod] = []
    timeline: list[object] = []
    description: str = ""
    start: str | None = None


class ConfigError(ValueError):
    pass


def load_local_cluster(path: Path) -> LocalCluster:
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read the cluster file: {exc}") from exc
    try:
        return msgspec.convert(raw, LocalCluster)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{path}: {exc}") from exc


def node_commands(cluster: LocalCluster) -> list[ConfigureNode]:
    return [
        ConfigureNode(
            node=node.name,
            policy_label=node.policy,
            qos_annotation=node.qos,
            gpu_count=node.gpus,
            exclusive_gpu_pods=tuple(node.exclusive_gpu_pods),
        )
        for node in cluster.nodes
    ]


def pod_commands(cluster: LocalCluster) -> list[Command]:
    return [RegisterPod(manifest=pod_manifest(pod)) for pod in cluster.pods]
