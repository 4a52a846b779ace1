"""The extender's cost per scheduler request at 5,000 nodes: /prioritize (fragmentation
scoring) against /filter on the same request, measured in the same run.

    .venv/bin/python bench/bench_extender.py [--nodes 5000] [--pods-per-node 6] [--repeat 5]

The cluster: ``--nodes`` share-pool nodes of 8 GPUs (as gpupool's node controller leaves
them), each with ``--pods-per-node`` GPU-sharing pods bound (shares drawn from the
openb default trace's 1-GPU shares, seeded), in the extender's ``ClusterCache``. One
request asks about a GPU-sharing pod of 40 % on every node (kube-scheduler sends full
node objects: ``nodeCacheCapable: false``). Measured, as the handlers run them (the
request body decoded, the rules applied, the answer encoded):

* /filter (the baseline: what the extender did before it scored by fragmentation);
* /prioritize, the same kind of pod again: every cost remembered (``ClusterCache.cost``:
  a node's costs live as long as its model and the workload);
* /prioritize, a new kind of pod: the node models and their fragmentation remembered,
  the pod's cost computed on each node (each repeat asks another CPU request);
* /prioritize, cold: every node model, fragmentation and cost rebuilt (after a restart);
* /prioritize as it was before the costs were remembered (the same rules, the
  placement cost computed on every node at every request and the share usage summed
  from the pod directory), warm models: the baseline of this change.

Both the wall time and the process's CPU time are shown: on a shared machine the CPU
time is the request's cost, the wall time what it took there. The budget is the
scheduler's ``httpTimeout`` for the extender (5 s in
deploy/scheduler/scheduler-config.yaml). Prints a table; no assertions.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from datetime import UTC, datetime
from typing import Any

import msgspec

from gpupool.extender.cluster_cache import ClusterCache
from gpupool.extender.protocol import decode_args, encode
from gpupool.extender.rules import prioritize
from gpupool.extender.service import ExtenderHandlers
from gpupool.kube.node_status import (
    NodeStatusSettings,
    OriginalResources,
    SharingEnabled,
    status_patch,
)
from gpupool.kube.records import Node, NodeStatus, ObjectMeta, Pod, PodChange

SHARES = (100, 100, 100, 81, 81, 47, 47, 32, 65, 23, 46)
"""Roughly the openb default trace's 1-GPU shares by frequency (percent)."""
HTTP_TIMEOUT_S = 5.0


def share_pool_node(name: str, gpus: int = 8) -> Node:
    capacity = {"cpu": "96", "memory": "512Gi", "nvidia.com/gpu": str(gpus)}
    patch = status_patch(
        OriginalResources(capacity=capacity, allocatable=capacity),
        SharingEnabled(policy="share-pool"),
        gpus=gpus,
        current=(),
        settings=NodeStatusSettings(),
        now=datetime(2025, 1, 1, tzinfo=UTC),
    )
    return Node(
        metadata=ObjectMeta(name=name, labels={"alibabacloud.com/gpu-share-policy": "share-pool"}),
        status=NodeStatus(
            capacity={**capacity, **{k: v for k, v in patch.capacity.items() if v is not None}},
            allocatable={
                **capacity,
                **{k: v for k, v in patch.allocatable.items() if v is not None},
            },
            conditions=patch.conditions,
        ),
    )


def share_pod(name: str, node: str, share: int, cpu: str = "4") -> dict[str, Any]:
    amounts = {
        "alibabacloud.com/gpu-core.percentage": str(share),
        "alibabacloud.com/gpu-memory.percentage": str(share),
    }
    return {
        "metadata": {
            "name": name,
            "namespace": "bench",
            "uid": name,
            "labels": {
                "alibabacloud.com/compute-class": "gpu-hpn",
                "alibabacloud.com/gpu-share-policy": "share-pool",
            },
        },
        "spec": {
            "nodeName": node,
            "containers": [
                {
                    "name": "main",
                    "resources": {
                        "requests": {**amounts, "cpu": cpu, "memory": "16Gi"},
                        "limits": amounts,
                    },
                }
            ],
        },
        "status": {"phase": "Running"},
    }


def timed(call: Any, repeat: int) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each call: on a shared machine the CPU time is the cost."""
    out = []
    for _ in range(repeat):
        start, cpu = time.perf_counter(), time.process_time()
        asyncio.run(call())
        out.append((time.perf_counter() - start, time.process_time() - cpu))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--pods-per-node", type=int, default=6)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    rng = random.Random(42)
    cache = ClusterCache(api=None)  # type: ignore[arg-type]  # the watch is not run here
    nodes = [share_pool_node(f"node-{i:05d}") for i in range(args.nodes)]
    for node in nodes:
        cache.nodes[node.name] = node
        for k in range(args.pods_per_node):
            raw = share_pod(f"{node.name}-p{k}", node.name, rng.choice(SHARES))
            cache.apply_pod(PodChange(type="ADDED", object=msgspec.convert(raw, Pod)))
    handlers = ExtenderHandlers(cache)
    node_items = [msgspec.to_builtins(node) for node in nodes]

    def request(cpu: str) -> bytes:
        return msgspec.json.encode(
            {"pod": share_pod("incoming", "", 40, cpu), "nodes": {"items": node_items}}
        )

    body = request("4")
    kinds = iter(range(1, 1 << 20))

    async def filter_once() -> None:
        status, _, _ = await handlers.filter(body)
        assert status == 200

    async def prioritize_once() -> None:
        status, _, _ = await handlers.prioritize(body)
        assert status == 200

    async def prioritize_new_kind() -> None:
        status, _, _ = await handlers.prioritize(request(f"{4000 + next(kinds)}m"))
        assert status == 200

    async def prioritize_cold() -> None:
        cache._models.clear()
        cache._costs.clear()
        await prioritize_once()

    async def prioritize_before() -> None:
        """The handler as it was: no remembered costs, usage summed from the directory."""
        args = decode_args(body)
        pod = msgspec.json.decode(args.pod, type=Pod)
        assert args.nodes is not None
        request_nodes = [msgspec.json.decode(raw, type=Node) for raw in args.nodes.items]
        ref = pod.ref

        def usage(name: str) -> Any:
            return cache.pods.share_usage(name, excluding=ref)

        encode(prioritize(pod, request_nodes, usage, cache.model, cache.workload()))

    asyncio.run(prioritize_once())  # fill the models, the costs and the workload
    rows = [
        ("/filter (baseline)", timed(filter_once, args.repeat)),
        ("/prioritize, same kind", timed(prioritize_once, args.repeat)),
        ("/prioritize, new kind", timed(prioritize_new_kind, args.repeat)),
        ("/prioritize, cold", timed(prioritize_cold, args.repeat)),
        ("/prioritize, before", timed(prioritize_before, args.repeat)),
    ]
    base = statistics.median(cpu for _, cpu in rows[0][1])
    print(
        f"{args.nodes} share-pool nodes × 8 GPUs, {args.pods_per_node} pods each "
        f"({args.nodes * args.pods_per_node} pods), request body {len(body) / 1e6:.1f} MB; "
        f"median of {args.repeat}"
    )
    print(
        f"{'request':<24} {'CPU s':>7} {'wall s':>7} {'CPU µs/node':>12} {'× filter':>9} "
        f"{'of 5 s':>7}"
    )
    for label, values in rows:
        cpu = statistics.median(c for _, c in values)
        wall = statistics.median(w for w, _ in values)
        print(
            f"{label:<24} {cpu:7.3f} {wall:7.3f} {1e6 * cpu / args.nodes:12.1f} "
            f"{cpu / base:9.2f} {cpu / HTTP_TIMEOUT_S:7.1%}"
        )


if __name__ == "__main__":
    main()
