"""The operator's QoS default (``--default-qos-config``, the chart's ``policy.defaultQosConfig``)
stands in for a GPU-sharing node's missing QoS annotation; a node's own annotation always wins,
and a default that is not a valid QoS configuration stops the policy service before it starts."""

from __future__ import annotations

import subprocess
import sys

from gpupool.core import parse_qos_annotation
from gpupool.core.validation import POLICY_LABEL, QOS_ANNOTATION
from gpupool.events import QosConfig
from gpupool.kube.node_controller import configure_command
from gpupool.kube.pod_directory import PodDirectory
from gpupool.kube.records import Node, ObjectMeta

DEFAULT = '{"preemptEnabled": true, "podMaxDurationMinutes": 120}'
OWN = '{"preemptEnabled": false}'


def node(annotations: dict[str, str]) -> Node:
    return Node(
        metadata=ObjectMeta(
            name="gpu-node-1", labels={POLICY_LABEL: "share-pool"}, annotations=annotations
        )
    )


def test_a_node_without_the_annotation_takes_the_default() -> None:
    command = configure_command(node({}), PodDirectory(), default_qos=DEFAULT)
    assert command.qos_annotation == DEFAULT
    qos = parse_qos_annotation(command.qos_annotation)
    assert isinstance(qos, QosConfig)
    assert qos.preempt_enabled and qos.pod_max_duration_minutes == 120


def test_a_nodes_own_annotation_wins_over_the_default() -> None:
    command = configure_command(node({QOS_ANNOTATION: OWN}), PodDirectory(), default_qos=DEFAULT)
    assert command.qos_annotation == OWN


def test_without_a_default_a_node_without_the_annotation_has_none() -> None:
    assert configure_command(node({}), PodDirectory()).qos_annotation is None


def test_an_invalid_default_stops_the_policy_service_with_the_reason() -> None:
    result = subprocess.run(
        [
            sys.executable, "-m", "gpupool.policy", "--kubernetes",
            "--default-qos-config", '{"preemptEnabled": "yes"}',
        ],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("gpupool policy: --default-qos-config: ")
    assert "preemptEnabled must be a bool" in result.stderr
