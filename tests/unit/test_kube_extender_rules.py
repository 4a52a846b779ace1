"""The extender's filter and prioritize rules, on a table of nodes and pods."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import msgspec
import pytest

from gpupool.events import Share
from gpupool.extender.rules import best_fit_score, filter_nodes, prioritize
from gpupool.kube.node_status import (
    ConfigurationRefused,
    NodeOutcome,
    NodeStatusSettings,
    SharingDisabled,
    SharingEnabled,
    original_resources,
    status_patch,
)
from gpupool.kube.records import Node, NodeStatus, ObjectMeta, Pod

T0 = datetime(2025, 1, 7, 4, 13, 4, tzinfo=UTC)
TWO_GPUS = {"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": "2"}


def node(name: str, label: str | None, *outcomes: NodeOutcome) -> Node:
    """A node as gpupool's node controller leaves it after ``outcomes`` (in order)."""
    current = Node(
        metadata=ObjectMeta(
            name=name, labels={} if label is None else {"alibabacloud.com/gpu-share-policy": label}
        ),
        status=NodeStatus(capacity=dict(TWO_GPUS), allocatable=dict(TWO_GPUS)),
    )
    for outcome in outcomes:
        patch = status_patch(
            original_resources(current),
            outcome,
            gpus=2,
            current=current.status.conditions,
            settings=NodeStatusSettings(),
            now=T0,
        )
        capacity = {**current.status.capacity, **patch.capacity}
        allocatable = {**current.status.allocatable, **patch.allocatable}
        current = Node(
            metadata=current.metadata,
            status=NodeStatus(
                capacity={k: v for k, v in capacity.items() if v is not None},
                allocatable={k: v for k, v in allocatable.items() if v is not None},
                conditions=patch.conditions,
            ),
        )
    return current


SHARE_POOL = SharingEnabled(policy="share-pool")
NODES = [
    node("share-pool", "share-pool", SHARE_POOL),
    node("static", "static", SharingEnabled(policy="static")),
    node("plain", None),
    node(
        "enabling",
        "share-pool",
        ConfigurationRefused(reason="ExclusiveGpuPodsPresent", message="cannot enable ..."),
    ),
    node(
        "bad-qos",
        "share-pool",
        SHARE_POOL,
        ConfigurationRefused(reason="InvalidQosConfig", message="annotation ... is not valid JSON"),
    ),
    node(
        "disabling",
        "none",
        SHARE_POOL,
        ConfigurationRefused(reason="SharePodsPresent", message="cannot disable ..."),
    ),
    node("disabled", "none", SHARE_POOL, SharingDisabled()),
    node("full", "share-pool", SHARE_POOL),
]
USED = {"full": Share(core=195, memory=100)}


def usage(name: str) -> Share:
    return USED.get(name, Share(core=0, memory=0))


def pod(
    *,
    labels: dict[str, str] | None = None,
    requests: dict[str, str] | None = None,
    limits: dict[str, str] | None = None,
) -> Pod:
    raw: dict[str, Any] = {
        "metadata": {"name": "p", "namespace": "default", "labels": labels or {}},
        "spec": {
            "containers": [
                {"name": "c", "resources": {"requests": requests or {}, "limits": limits or {}}}
            ]
        },
    }
    return msgspec.convert(raw, Pod)


def share(policy: str, request: int = 10, limit: int = 100, compute_class: str = "gpu-hpn") -> Pod:
    return pod(
        labels={
            "alibabacloud.com/compute-class": compute_class,
            "alibabacloud.com/gpu-share-policy": policy,
        },
        requests={
            "alibabacloud.com/gpu-core.percentage": str(request),
            "alibabacloud.com/gpu-memory.percentage": str(request),
        },
        limits={
            "alibabacloud.com/gpu-core.percentage": str(limit),
            "alibabacloud.com/gpu-memory.percentage": str(limit),
        },
    )


EXCLUSIVE_OFF = "GPU sharing ({}) is on for this node: pods requesting whole GPUs (nvidia.com/gpu) are kept off it"
NOT_ENABLED = "GPU sharing is not enabled on this node (condition GPUSharePolicy is not True)"


@pytest.mark.parametrize(
    ("the_pod", "passed", "failed"),
    [
        pytest.param(
            pod(requests={"nvidia.com/gpu": "1"}, limits={"nvidia.com/gpu": "1"}),
            ["plain", "disabled"],
            {
                "share-pool": EXCLUSIVE_OFF.format("share-pool"),
                "static": EXCLUSIVE_OFF.format("static"),
                "enabling": EXCLUSIVE_OFF.format("share-pool"),
                "bad-qos": EXCLUSIVE_OFF.format("share-pool"),
                "disabling": EXCLUSIVE_OFF.format("share-pool"),
                "full": EXCLUSIVE_OFF.format("share-pool"),
            },
            id="whole-gpu-pod-only-on-non-sharing-nodes",
        ),
        pytest.param(
            share("share-pool"),
            ["share-pool"],
            {
                "static": "the node's GPU share policy is static, the pod's is share-pool",
                "plain": NOT_ENABLED,
                "enabling": NOT_ENABLED,
                "bad-qos": "the node's GPU share policy configuration is invalid "
                "(InvalidQosConfig): annotation ... is not valid JSON",
                "disabling": "the node is being switched from share-pool to none",
                "disabled": NOT_ENABLED,
                "full": "insufficient alibabacloud.com/gpu-core.percentage: the pod requests 10, "
                "5 of 200 are free",
            },
            id="share-pool-pod",
        ),
        pytest.param(
            share("static"),
            ["static"],
            {
                "share-pool": "the node's GPU share policy is share-pool, the pod's is static",
                "plain": NOT_ENABLED,
                "enabling": NOT_ENABLED,
                "bad-qos": "the node's GPU share policy is share-pool, the pod's is static",
                "disabling": "the node's GPU share policy is share-pool, the pod's is static",
                "disabled": NOT_ENABLED,
                "full": "the node's GPU share policy is share-pool, the pod's is static",
            },
            id="static-pod",
        ),
        pytest.param(
            pod(requests={"cpu": "2", "memory": "4Gi"}),
            [n.name for n in NODES],
            {},
            id="cpu-only-pod-anywhere",
        ),
    ],
)
def test_filter(the_pod: Pod, passed: list[str], failed: dict[str, str]) -> None:
    outcome = filter_nodes(the_pod, NODES, usage)
    assert outcome.passed == passed
    assert outcome.failed == failed


@pytest.mark.parametrize(
    ("the_pod", "reason"),
    [
        pytest.param(
            share("share-pool", request=50, limit=10),
            "not a valid GPU-sharing pod (LimitBelowRequest): container 'c' "
            "alibabacloud.com/gpu-core.percentage: limit 10 is below request 50",
            id="limit-below-request",
        ),
        pytest.param(
            share("share-pool", compute_class="general-purpose"),
            "not a valid GPU-sharing pod (UnsupportedComputeClass): label "
            "alibabacloud.com/compute-class is 'general-purpose'; only 'gpu-hpn' is supported",
            id="not-gpu-hpn",
        ),
        pytest.param(
            share("exclusive"),
            "not a valid GPU-sharing pod (InvalidSharePolicy): label "
            "alibabacloud.com/gpu-share-policy is 'exclusive'; it must be 'share-pool' or 'static'",
            id="unknown-policy",
        ),
    ],
)
def test_invalid_share_pods_fit_nowhere(the_pod: Pod, reason: str) -> None:
    outcome = filter_nodes(the_pod, NODES, usage)
    assert outcome.passed == []
    assert outcome.failed == {n.name: reason for n in NODES}


def test_memory_is_checked_too() -> None:
    tight = {"share-pool": Share(core=0, memory=195)}
    outcome = filter_nodes(share("share-pool"), NODES[:1], lambda n: tight[n])
    assert outcome.failed == {
        "share-pool": "insufficient alibabacloud.com/gpu-memory.percentage: the pod requests 10, "
        "5 of 200 are free"
    }


def test_prioritize_prefers_the_fullest_node_that_fits() -> None:
    half = node("half-used", "share-pool", SHARE_POOL)
    empty = node("empty", "share-pool", SHARE_POOL)
    full = node("full", "share-pool", SHARE_POOL)
    used = {
        "half-used": Share(core=100, memory=100),
        "empty": Share(core=0, memory=0),
        "full": Share(core=180, memory=180),
    }
    scores = prioritize(
        share("share-pool", request=50),
        [empty, half, full, NODES[2]],
        lambda n: used.get(n, Share(core=0, memory=0)),
    )
    assert [(s.host, s.score) for s in scores] == [
        ("empty", 2),
        ("half-used", 7),
        ("full", 0),
        ("plain", 0),
    ]


def test_best_fit_score_is_0_to_10() -> None:
    enabled = NODES[0]
    assert best_fit_score(enabled, Share(core=0, memory=0), Share(core=1, memory=1)) == 0
    assert best_fit_score(enabled, Share(core=100, memory=0), Share(core=100, memory=200)) == 10
    assert best_fit_score(enabled, Share(core=150, memory=50), Share(core=10, memory=10)) == 5


def test_whole_gpu_pods_get_no_preference() -> None:
    exclusive = pod(requests={"nvidia.com/gpu": "1"})
    assert {s.score for s in prioritize(exclusive, NODES, usage)} == {0}
