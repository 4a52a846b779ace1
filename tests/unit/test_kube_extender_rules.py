"""The extender's filter and prioritize rules, on a table of nodes and pods."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import msgspec
import pytest

from gpupool.core.fragmentation import NodeFree, Task, Workload
from gpupool.events import Share
from gpupool.extender.rules import (
    NodeModel,
    filter_nodes,
    node_model,
    placement_cost,
    pod_task,
    prioritize,
    scores_by_cost,
)
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


def bound_share_pod(limit: int, *, cpu: str = "1") -> Pod:
    """A GPU-sharing pod asking ``limit`` % of a GPU as requests and limits, and ``cpu``."""
    amounts = {
        "alibabacloud.com/gpu-core.percentage": str(limit),
        "alibabacloud.com/gpu-memory.percentage": str(limit),
    }
    return pod(
        labels={
            "alibabacloud.com/compute-class": "gpu-hpn",
            "alibabacloud.com/gpu-share-policy": "share-pool",
        },
        requests={**amounts, "cpu": cpu, "memory": "1Gi"},
        limits=amounts,
    )


def test_node_model_places_the_bound_pods_by_the_cores_gpu_choice() -> None:
    model = node_model(NODES[0], [bound_share_pod(60), bound_share_pod(30), bound_share_pod(50)])
    # 60 on GPU 0; the 30 joins it (the 40 left there was a fragment for the 60 and the
    # 50 seen: gradient -16.7 against 0 on GPU 1); the 50 cannot join 90: GPU 1
    assert model.usage == {0: Share(core=90, memory=90), 1: Share(core=50, memory=50)}
    assert model.waiting == 0
    # allocatable CPU: 64 less the 32 gpupool reserves on an enabled node; 1 per pod
    assert model.free.cpu_milli == 32000 - 3000
    assert model.free.gpus == (Share(core=10, memory=10), Share(core=50, memory=50))
    # a third pod of 60 fits no GPU by limits: it waits
    assert node_model(NODES[0], [bound_share_pod(60), bound_share_pod(60)]).waiting == 0
    assert node_model(NODES[0], [bound_share_pod(60)] * 3).waiting == 1


def test_prioritize_prefers_the_node_where_the_pod_leaves_no_unusable_sliver() -> None:
    sixty = node("sixty-used", "share-pool", SHARE_POOL)
    empty = node("empty", "share-pool", SHARE_POOL)
    bound = {"sixty-used": [bound_share_pod(60)], "empty": []}
    # the cluster runs 60 % and 40 % pods, one each
    workload = Workload.of(
        [Task(cpu_milli=1000, memory_mib=1024, share=Share(core=c, memory=c)) for c in (60, 40)]
    )
    scores = prioritize(
        bound_share_pod(40),
        [empty, sixty, NODES[2]],
        lambda name: Share(core=60, memory=60) if name == "sixty-used" else Share(core=0, memory=0),
        lambda n: node_model(n, bound[n.name]),
        workload,
    )
    # beside the 60 it fills the GPU (the 40 left there was a fragment for 60 % pods:
    # gradient -20); on the empty node it leaves 60 and 100, both usable (gradient 0);
    # "plain" is filtered out
    assert [(s.host, s.score) for s in scores] == [("empty", 5), ("sixty-used", 10), ("plain", 0)]


def test_scores_by_cost_ranks_nodes_that_fit_now_above_those_that_would_wait() -> None:
    costs = {
        "best": (0, -5.0, 0.1),
        "tied": (0, -5.0, 0.1),
        "next": (0, 0.0, 0.5),
        "worst": (0, 3.0, 0.9),
        "queue-blocked": (1, 0.0, 0.0),
        "would-block": (2, 0.0, 0.0),
    }
    assert scores_by_cost(costs) == {
        "best": 10,
        "tied": 10,
        "next": 7,  # 9 - 8 x 1 // 3 distinct costs
        "worst": 4,  # 9 - 8 x 2 // 3
        "queue-blocked": 1,
        "would-block": 0,
    }


def test_whole_gpu_and_cpu_only_pods_are_scored_too() -> None:
    plain = node("plain", None)
    busy = node("busy", None)
    whole = pod(requests={"nvidia.com/gpu": "1", "cpu": "1"})
    assert pod_task(whole) == Task(cpu_milli=1000, gpus=1, share=Share(core=100, memory=100))
    cpu_only = pod(requests={"cpu": "500m", "memory": "2Gi"})
    assert pod_task(cpu_only) == Task(
        cpu_milli=500, memory_mib=2048, gpus=0, share=Share(core=0, memory=0)
    )
    # "busy" runs a whole-GPU pod; a 2-GPU task is part of the workload: taking the
    # last free GPU of "busy" leaves no pair anywhere there, on "plain" it keeps... none
    # either way; a 1-GPU pod is best where it does not break up a free pair
    bound = {"plain": [], "busy": [whole]}
    workload = Workload.of(
        [
            Task(cpu_milli=1000, gpus=2),
            Task(cpu_milli=1000, gpus=1, share=Share(core=100, memory=100)),
        ]
    )
    scores = prioritize(
        whole, [plain, busy], usage, lambda n: node_model(n, bound[n.name]), workload
    )
    assert [(s.host, s.score) for s in scores] == [("plain", 5), ("busy", 10)]


def test_a_cpu_only_pod_goes_where_cpu_is_to_spare_for_the_free_gpus() -> None:
    # the GPU pods ask 2 CPUs per 50 %: 40 milli per percent of GPU. Both nodes have two
    # free GPUs; "tight" has 10 CPUs (enough for 250 %), "roomy" 40.
    workload = Workload.of([Task(cpu_milli=2000, memory_mib=0, share=Share(core=50, memory=50))])
    free = (Share(core=100, memory=100),) * 2
    usage = {0: Share(core=0, memory=0), 1: Share(core=0, memory=0)}

    def model(cpu: int) -> NodeModel:
        return NodeModel(free=NodeFree(cpu_milli=cpu, memory_mib=0, gpus=free), usage=usage)

    cpu_only = Task(cpu_milli=4000, gpus=0, share=Share(core=0, memory=0))
    # plain FGD sees no fragment on either (every task still fits); on "tight" the 6 CPUs
    # left carry 150 % of the 200 % free: 50 stranded
    assert placement_cost(model(10000), cpu_only, workload)[0] == (0, 50.0, 1.0)
    assert placement_cost(model(40000), cpu_only, workload)[0] == (0, 0.0, 1.0)


def test_the_cache_folds_the_live_pods_into_the_workload_and_drops_stale_models() -> None:
    from gpupool.extender.cluster_cache import ClusterCache
    from gpupool.kube.records import PodChange

    cache = ClusterCache(api=None)  # type: ignore[arg-type]  # the watch is not run
    bound = msgspec.structs.replace(
        bound_share_pod(60),
        spec=msgspec.structs.replace(bound_share_pod(60).spec, node_name="share-pool"),
    )
    assert not cache.workload()
    cache.apply_pod(PodChange(type="ADDED", object=bound))
    task = Task(cpu_milli=1000, memory_mib=1024, share=Share(core=60, memory=60))
    assert dict(cache.workload().weights) == {task: 1.0}
    assert cache.model(NODES[0]).usage[0] == Share(core=60, memory=60)
    cache.apply_pod(PodChange(type="DELETED", object=bound))
    assert not cache.workload()
    assert cache.model(NODES[0]).usage[0] == Share(core=0, memory=0)


def test_the_cache_remembers_costs_that_equal_the_rules_and_refolds_after_drift() -> None:
    from gpupool.extender.cluster_cache import WORKLOAD_DRIFT, ClusterCache
    from gpupool.kube.records import PodChange

    cache = ClusterCache(api=None)  # type: ignore[arg-type]  # the watch is not run
    share_pool = NODES[0]

    def bound(name: str, limit: int) -> Pod:
        raw = bound_share_pod(limit)
        return msgspec.structs.replace(
            raw,
            metadata=msgspec.structs.replace(raw.metadata, name=name, uid=name),
            spec=msgspec.structs.replace(raw.spec, node_name=share_pool.name),
        )

    pods = 2 * WORKLOAD_DRIFT
    for k in range(pods):
        cache.apply_pod(PodChange(type="ADDED", object=bound(f"p{k}", 1)))
    folded = cache.workload()
    assert folded.total == pods
    task = pod_task(bound_share_pod(40))
    assert task is not None
    expected = placement_cost(cache.model(share_pool), task, folded)[0]
    assert cache.cost(share_pool, task) == expected
    # the share usage kept from the watch is the directory's sum
    assert cache.share_usage(share_pool.name) == cache.pods.share_usage(share_pool.name)
    assert cache.share_usage(share_pool.name, excluding=bound("p0", 1).ref) == Share(
        core=pods - 1, memory=pods - 1
    )
    # one more pod of a kind already seen: not refolded (1 of 64 changed) ...
    cache.apply_pod(PodChange(type="ADDED", object=bound("extra", 1)))
    assert cache.workload() is folded
    # an update that keeps the pod's kind (a status change) is no drift at all
    cache.apply_pod(PodChange(type="MODIFIED", object=bound("extra", 1)))
    cache.apply_pod(PodChange(type="MODIFIED", object=bound("extra", 1)))
    assert cache.workload() is folded
    # ... but the node's model changed, so its cost is computed again
    assert cache.cost(share_pool, task) == placement_cost(cache.model(share_pool), task, folded)[0]
    # a kind the workload has not seen refolds it at once
    cache.apply_pod(PodChange(type="ADDED", object=bound("new-kind", 30)))
    assert cache.workload() is not folded
    assert cache.workload().total == pods + 2
    # deleted pods leave the usage
    cache.apply_pod(PodChange(type="DELETED", object=bound("new-kind", 30)))
    assert cache.share_usage(share_pool.name) == Share(core=pods + 1, memory=pods + 1)
