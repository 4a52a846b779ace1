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


MAX_CLUSTER_FILE_BYTES = 16 * 1024 * 1024
"""The largest cluster file read (a 16-GPU node with its pods takes a few kilobytes)."""


def load_local_cluster(path: Path) -> LocalCluster:
    """The cluster file's nodes and pods; any other content is a :class:`ConfigError` saying why.

    The file is bounded in size and nesting (a RecursionError of the YAML parser, or of
    a self-referencing alias, is a ConfigError too); names and numbers are checked when
    the policy service decides on them (``gpupool.core.input_bounds``).
    """
    try:
        size = path.stat().st_size
        if size > MAX_CLUSTER_FILE_BYTES:
            raise ConfigError(
                f"{path}: the cluster file is {size} bytes; at most {MAX_CLUSTER_FILE_BYTES} are read"
            )
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the cluster file: {exc}") from exc
    except RecursionError as exc:
        raise ConfigError(f"{path}: the cluster file nests deeper than it can: {exc}") from exc
    try:
        return msgspec.convert(raw, LocalCluster)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    except UnicodeError as exc:  # YAML lets lone surrogates through ("\ud800")
        raise ConfigError(
            f"{path}: the cluster file holds text that is not Unicode: {exc}"
        ) from exc
    except RecursionError as exc:
        raise ConfigError(
            f"{path}: the cluster file refers to itself (a YAML alias cycle)"
        ) from exc


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
