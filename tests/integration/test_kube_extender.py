"""The scheduler extender over HTTP, called the way kube-scheduler calls it, with kmock as the API.

One test runs the real process (``python -m gpupool.extender``) on a table of nodes
and pods; one runs the handlers in-process to watch the cache follow new pods.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import kmock
import pytest
from kube_harness import (
    Activity,
    ObservedApi,
    connect,
    declare_resources,
    kubectl,
    pod_object,
    running,
    share_pod,
)

from gpupool.extender.cluster_cache import ClusterCache
from gpupool.extender.service import ExtenderHandlers
from gpupool.runtime.http import HttpEndpoint

CORE = "alibabacloud.com/gpu-core.percentage"
MEMORY = "alibabacloud.com/gpu-memory.percentage"


def condition(type_: str, status: str, reason: str, message: str) -> dict[str, str]:
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "lastHeartbeatTime": "2025-01-07T04:13:04Z",
        "lastTransitionTime": "2025-01-07T04:13:04Z",
    }


def gpu_node(
    name: str, label: str | None, in_force: str | None, invalid: str = ""
) -> dict[str, Any]:
    """A 2-GPU node as gpupool's node controller leaves it."""
    resources = {"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": "2"}
    if in_force is not None:
        resources = {**resources, CORE: "200", MEMORY: "200"}
    conditions = [
        condition("GPUSharePolicyValid", "False", "InvalidQosConfig", invalid)
        if invalid
        else condition("GPUSharePolicyValid", "True", "Valid", "gpu share policy is valid."),
        condition(
            "GPUSharePolicy",
            "True" if in_force else "False",
            in_force or "none",
            f"gpu share policy is {in_force or 'none'}.",
        ),
    ]
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {"alibabacloud.com/gpu-share-policy": label} if label else {},
        },
        "status": {
            "capacity": dict(resources),
            "allocatable": dict(resources),
            "conditions": conditions if label else [],
        },
    }


NODES = [
    gpu_node("pool-a", "share-pool", "share-pool"),
    gpu_node("pool-b", "share-pool", "share-pool"),
    gpu_node("static-a", "static", "static"),
    gpu_node("plain", None, None),
    gpu_node("bad-qos", "share-pool", "share-pool", invalid="annotation ... is not valid JSON"),
]
# Already bound: pool-a has 150 of 200 requested, pool-b 40.
BOUND = [
    share_pod("a1", "pool-a", request=100),
    share_pod("a2", "pool-a", request=50),
    share_pod("b1", "pool-b", request=40),
    share_pod("done", "pool-b", request=100, phase="Succeeded"),  # holds nothing any more
]

EXCLUSIVE = pod_object("trainer", requests={"nvidia.com/gpu": "1"}, limits={"nvidia.com/gpu": "1"})
SHARE_60 = share_pod("notebook", "", request=60)
SHARE_40 = share_pod("small", "", request=40)
STATIC = share_pod("pinned", "", policy="static", request=30)
CPU_ONLY = pod_object("web", requests={"cpu": "1"})
KEPT_OFF = "GPU sharing ({}) is on for this node: pods requesting whole GPUs (nvidia.com/gpu) are kept off it"
NOT_ENABLED = "GPU sharing is not enabled on this node (condition GPUSharePolicy is not True)"
BAD_QOS = (
    "the node's GPU share policy configuration is invalid (InvalidQosConfig): "
    "annotation ... is not valid JSON"
)

# (case, pod, nodes that pass, reasons of those that fail, prioritize scores)
TABLE: list[tuple[str, dict[str, Any], list[str], dict[str, str], dict[str, int]]] = [
    (
        "whole-gpu",
        EXCLUSIVE,
        ["plain"],
        {
            "pool-a": KEPT_OFF.format("share-pool"),
            "pool-b": KEPT_OFF.format("share-pool"),
            "static-a": KEPT_OFF.format("static"),
            "bad-qos": KEPT_OFF.format("share-pool"),
        },
        {"pool-a": 0, "pool-b": 0, "static-a": 0, "plain": 10, "bad-qos": 0},
    ),
    (
        "share-60",
        SHARE_60,
        ["pool-b"],
        {
            "pool-a": f"insufficient {CORE}: the pod requests 60, 50 of 200 are free",
            "static-a": "the node's GPU share policy is static, the pod's is share-pool",
            "plain": NOT_ENABLED,
            "bad-qos": BAD_QOS,
        },
        {"pool-a": 0, "pool-b": 10, "static-a": 0, "plain": 0, "bad-qos": 0},
    ),
    (
        # pool-a's two GPUs are full by limits (a1 and a2 have limits 100): the pod would
        # wait there; on pool-b it fits GPU 1 now
        "share-40-fits-a-gpu-now",
        SHARE_40,
        ["pool-a", "pool-b"],
        {
            "static-a": "the node's GPU share policy is static, the pod's is share-pool",
            "plain": NOT_ENABLED,
            "bad-qos": BAD_QOS,
        },
        {"pool-a": 0, "pool-b": 10, "static-a": 0, "plain": 0, "bad-qos": 0},
    ),
    (
        "static",
        STATIC,
        ["static-a"],
        {
            "pool-a": "the node's GPU share policy is share-pool, the pod's is static",
            "pool-b": "the node's GPU share policy is share-pool, the pod's is static",
            "plain": NOT_ENABLED,
            "bad-qos": "the node's GPU share policy is share-pool, the pod's is static",
        },
        {"pool-a": 0, "pool-b": 0, "static-a": 10, "plain": 0, "bad-qos": 0},
    ),
    (
        "cpu-only",
        CPU_ONLY,
        ["pool-a", "pool-b", "static-a", "plain", "bad-qos"],
        {},
        # scored too (when the scheduler sends it): its CPU is best where the GPUs are
        # already taken (pool-a: no free GPU to strand), then where fewest are free
        {"pool-a": 10, "pool-b": 7, "static-a": 4, "plain": 4, "bad-qos": 4},
    ),
]


class ExtenderProcess:
    def __init__(self, process: asyncio.subprocess.Process, url: str) -> None:
        self.process = process
        self.url = url
        self.lines: list[str] = []


async def _read_until(
    process: asyncio.subprocess.Process, pattern: str, lines: list[str]
) -> re.Match[str]:
    assert process.stderr is not None
    while True:
        raw = await process.stderr.readline()
        if not raw:
            raise AssertionError("the extender exited:\n" + "".join(lines))
        line = raw.decode()
        lines.append(line)
        match = re.search(pattern, line)
        if match:
            return match


@pytest.fixture
async def extender(kmock: kmock.KubernetesEmulator) -> AsyncIterator[ExtenderProcess]:
    declare_resources(kmock)
    for node in NODES:
        await kubectl(kmock, "POST", "/api/v1/nodes", node)
    for pod in BOUND:
        await kubectl(kmock, "POST", "/api/v1/namespaces/default/pods", pod)
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gpupool.extender",
        "--http-host",
        "127.0.0.1",
        "--http-port",
        "0",
        "--server",
        str(kmock.url),
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []
    try:
        async with asyncio.timeout(30):
            listening = await _read_until(process, r"listening on (http://\S+)", lines)
            await _read_until(process, r"ready: 5 nodes, 4 pods cached", lines)
        started = ExtenderProcess(process, listening.group(1))
        started.lines = lines
        yield started
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(15):
            assert process.stderr is not None
            rest = await process.stderr.read()
            code = await process.wait()
        lines.append(rest.decode())
        assert code == 0, "".join(lines)
        assert "gpupool-extender stopped" in "".join(lines)


async def post(url: str, body: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        return response.status, await response.json(content_type=None)


async def test_filter_and_prioritize_over_http(extender: ExtenderProcess) -> None:
    """The whole table against one extender process (starting one takes seconds)."""
    names = [n["metadata"]["name"] for n in NODES]
    for case, pod, passed, failed, scores in TABLE:
        # nodeCacheCapable: false — whole nodes in, the passing nodes back (as they came)
        status, result = await post(
            f"{extender.url}/filter", {"pod": pod, "nodes": {"items": NODES}}
        )
        assert status == 200, case
        assert result["nodes"]["items"] == [n for n in NODES if n["metadata"]["name"] in passed], (
            case
        )
        assert result.get("failedNodes", {}) == failed, case
        assert "nodenames" not in result and not result.get("error"), case

        # nodeCacheCapable: true — names in, names back; the extender's cache supplies the nodes
        status, result = await post(f"{extender.url}/filter", {"pod": pod, "nodenames": names})
        assert (status, result["nodenames"], result.get("failedNodes", {})) == (
            200,
            passed,
            failed,
        ), case

        status, priorities = await post(
            f"{extender.url}/prioritize", {"pod": pod, "nodenames": names}
        )
        assert status == 200, case
        assert {p["host"]: p["score"] for p in priorities} == scores, case


async def test_health_and_bad_requests(extender: ExtenderProcess) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{extender.url}/healthz") as response:
            assert (response.status, await response.text()) == (200, "ok\n")
        async with session.get(f"{extender.url}/readyz") as response:
            assert response.status == 200
        async with session.post(f"{extender.url}/filter", data=b"{not json") as response:
            body = await response.json(content_type=None)
            assert response.status == 400
            assert body["error"].startswith("cannot read ExtenderArgs")
    # Go's encoding/json matches field names case-insensitively; so does the extender
    status, result = await post(
        f"{extender.url}/filter", {"Pod": EXCLUSIVE, "NodeNames": ["plain", "pool-a"]}
    )
    assert (status, result["nodenames"], list(result["failedNodes"])) == (
        200,
        ["plain"],
        ["pool-a"],
    )
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{extender.url}/metrics") as response,
    ):
        metrics = await response.text()
    assert "gpupool_extender_ready 1.0" in metrics
    assert "gpupool_extender_cached_nodes 5.0" in metrics
    assert "gpupool_extender_cached_pods 4.0" in metrics
    assert 'gpupool_extender_requests_total{outcome="bad-request",verb="filter"} 1.0' in metrics
    assert 'gpupool_extender_requests_total{outcome="ok",verb="filter"} 1.0' in metrics


async def test_the_cache_follows_pods_bound_after_start(kmock: kmock.KubernetesEmulator) -> None:
    declare_resources(kmock)
    await kubectl(kmock, "POST", "/api/v1/nodes", NODES[0])
    activity = Activity()
    async with await connect(kmock) as adapter:
        api = ObservedApi(adapter, activity)
        cache = ClusterCache(api)
        endpoint = HttpEndpoint(is_ready=lambda: cache.ready)
        ExtenderHandlers(cache).install(endpoint)
        port = await endpoint.start("127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}"
        try:
            async with running(cache.run()):
                await activity.until(lambda: cache.ready)
                ask = {"pod": SHARE_60, "nodenames": ["pool-a"]}
                assert (await post(f"{url}/filter", ask))[1]["nodenames"] == ["pool-a"]

                # the scheduler binds a 150% pod there; the next 60% no longer fits
                await kubectl(kmock, "POST", "/api/v1/namespaces/default/pods", BOUND[0])
                await kubectl(kmock, "POST", "/api/v1/namespaces/default/pods", BOUND[1])
                await activity.until(lambda: len(cache.pods.on_node("pool-a")) == 2)
                status, result = await post(f"{url}/filter", ask)
                assert (status, result["nodenames"]) == (200, [])
                assert result["failedNodes"] == {
                    "pool-a": f"insufficient {CORE}: the pod requests 60, 50 of 200 are free"
                }

                # it completes: the room is back
                await kubectl(kmock, "DELETE", "/api/v1/namespaces/default/pods/a1")
                await activity.until(lambda: len(cache.pods.on_node("pool-a")) == 1)
                assert (await post(f"{url}/filter", ask))[1]["nodenames"] == ["pool-a"]
        finally:
            await endpoint.stop()
