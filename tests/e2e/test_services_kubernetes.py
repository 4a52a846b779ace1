"""The policy service process in Kubernetes mode: the API is kmock (a real HTTP server
speaking the Kubernetes REST protocol: there is no kube-apiserver here), the log is a real
JetStream. Node enablement is patched, pods become log events, rejections become Kubernetes
Events, a Preempted in the log is recorded on both pods, a deleted pod leaves the log's queue."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kmock
import pytest
from stack_harness import follow_log

from gpupool.eventlog.jetstream import JetStreamEventLog
from gpupool.eventlog.nats_server import run_nats_server
from gpupool.events import (
    Assigned,
    Envelope,
    GpuInfo,
    GpuInventoryReported,
    NodeConfigured,
    PodReady,
    PodRef,
    PodRegistered,
    PodRejected,
    PodRemoved,
    Preempted,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from kube_harness import (
    POLICY_LABEL,
    QOS_ANNOTATION,
    SOURCE_NODE,
    SOURCE_QOS,
    kubectl,
    node_object,
    share_pod,
)

PODS = "/api/v1/namespaces/default/pods"
EVENTS = "/api/v1/namespaces/default/events"


@pytest.fixture
async def nats_server(tmp_path: Path) -> AsyncIterator[str]:
    async with run_nats_server(tmp_path / "nats") as url:
        yield url


def has(kind: type, name: str | None = None) -> Callable[[list[Envelope]], bool]:
    def check(log: list[Envelope]) -> bool:
        return any(
            isinstance(e.event, kind) and (name is None or e.event.pod.name == name) for e in log
        )

    return check


async def until(server: kmock.KubernetesEmulator, watch: str, predicate: Callable[[], Any]) -> Any:
    """Re-check ``predicate`` each time the API server reports a change on ``watch``."""
    async with asyncio.timeout(30):
        if found := await predicate():
            return found
        response = await server.request("GET", f"{watch}?watch=true")
        async with response:
            async for _ in response.content:  # one line per watch event
                if found := await predicate():
                    return found
    raise AssertionError(f"the watch on {watch} ended first")


async def test_policy_service_in_kubernetes_mode(
    kmock: kmock.KubernetesEmulator, nats_server: str, tmp_path: Path
) -> None:
    await kubectl(
        kmock,
        "POST",
        "/api/v1/nodes",
        node_object(
            labels={POLICY_LABEL: "share-pool"},
            annotations={QOS_ANNOTATION: SOURCE_QOS},
        ),
    )
    await kubectl(kmock, "POST", PODS, share_pod("gpu-share-demo"))
    await kubectl(kmock, "POST", PODS, share_pod("newcomer"))
    bad = share_pod("too-big", limit=150)
    await kubectl(kmock, "POST", PODS, bad)

    policy = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gpupool.policy",
        "--kubernetes",
        "--kube-server",
        str(kmock.url),
        "--nats",
        nats_server,
        "--http-port",
        "0",
        "--instance",
        "test",
        stdout=(tmp_path / "policy.log").open("wb"),
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        log = await follow_log(
            nats_server,
            lambda log: (
                has(NodeConfigured)(log)
                and has(PodRegistered, "newcomer")(log)
                and has(PodRejected, "too-big")(log)
            ),
        )
        configured = next(e.event for e in log if isinstance(e.event, NodeConfigured))
        assert (configured.node, configured.policy, configured.gpu_count) == (
            SOURCE_NODE,
            "share-pool",
            16,
        )
        assert configured.qos.preempt_enabled and configured.qos.pod_max_duration_minutes == 120

        async def node_status() -> dict[str, Any] | None:
            node = await kubectl(kmock, "GET", f"/api/v1/nodes/{SOURCE_NODE}")
            status: dict[str, Any] = node.get("status", {})
            return (
                status
                if "alibabacloud.com/gpu-core.percentage" in status.get("allocatable", {})
                else None
            )

        status = await until(kmock, "/api/v1/nodes", node_status)
        assert status["allocatable"]["alibabacloud.com/gpu-core.percentage"] == "1600"
        assert status["allocatable"]["ephemeral-storage"] == "4608Gi"
        conditions = {c["type"]: c for c in status["conditions"]}
        assert (
            conditions["GPUSharePolicy"]["reason"],
            conditions["GPUSharePolicy"]["message"],
        ) == (
            "share-pool",
            "gpu share policy is share-pool.",
        )

        async def events() -> list[dict[str, Any]]:
            response = await kmock.request("GET", EVENTS)
            async with response:
                if response.status == 404:
                    # kmock knows the Event resource only once the first one is created;
                    # until() re-checks on every change the watch on EVENTS reports
                    return []
                assert response.status < 300, await response.text()
                return list((await response.json())["items"])

        rejection = await until(
            kmock, EVENTS, lambda: _first(events, "too-big", "InvalidPercentage")
        )
        assert "at most 100" in rejection["message"]

        # a Preempted in the log (as the preemption service appends it) is recorded on both pods
        victim, preemptor = (
            PodRef(namespace="default", name=n) for n in ("gpu-share-demo", "newcomer")
        )
        writer = await JetStreamEventLog.connect(nats_server)
        # the victim runs and the preemptor waits, as the executor and admission-queue record
        # it: a Preempted of a pod not running would not be believed (admission_check)
        at = datetime(2025, 4, 22, 8, 12, 0, tzinfo=UTC)
        for number, event in enumerate(
            [
                # the node's GPUs, as its executor reports them: a claim on a GPU the log
                # has never seen is not folded
                GpuInventoryReported(
                    node=SOURCE_NODE,
                    gpus=[GpuInfo(index=0, uuid="GPU-0", memory_mib=81559)],
                    source="simulated",
                ),
                PodReady(pod=victim, node=SOURCE_NODE),
                Assigned(pod=victim, node=SOURCE_NODE, gpu_index=0, gpu_uuid="GPU-0"),
                PodReady(pod=preemptor, node=SOURCE_NODE),
            ]
        ):
            await writer.append(Envelope(id=f"before-preempted-{number}", time=at, event=event))
        await writer.append(
            Envelope(
                id="preempted-1",
                time=datetime(2025, 4, 22, 8, 12, 9, tzinfo=UTC),
                event=Preempted(
                    victim=victim,
                    preemptor=preemptor,
                    node=SOURCE_NODE,
                    gpu_index=0,
                    gpu_uuid="GPU-0",
                    reason="priority",
                ),
            )
        )
        await writer.close()
        victim_event = await until(
            kmock, EVENTS, lambda: _first(events, "gpu-share-demo", "GPUSharePreempted")
        )
        preemptor_event = await until(
            kmock, EVENTS, lambda: _first(events, "newcomer", "GPUSharePreempt")
        )
        assert (
            victim_event["type"],
            victim_event["message"],
            victim_event["source"]["component"],
        ) == (
            "Warning",
            "GPU is preempted by newcomer.",
            "gpushare",
        )
        assert preemptor_event["message"] == "GPU is preempted from gpu-share-demo."

        async def reclaim() -> dict[str, Any] | None:
            pod = await kubectl(kmock, "GET", f"{PODS}/gpu-share-demo")
            for condition in pod.get("status", {}).get("conditions", []):
                if condition["type"] == "Interruption.GPUShareReclaim":
                    return dict(condition)
            return None

        condition = await until(kmock, PODS, reclaim)
        assert condition == {
            "type": "Interruption.GPUShareReclaim",
            "status": "True",
            "reason": "GPUSharePreempted",
            "message": "GPU is preempted by newcomer.",
            "lastTransitionTime": "2025-04-22T08:12:09Z",
            "lastProbeTime": "2025-04-22T08:12:09Z",
        }

        # deleting a pod removes it from the log's queues
        await kubectl(kmock, "DELETE", f"{PODS}/newcomer")
        await follow_log(nats_server, has(PodRemoved, "newcomer"))
    finally:
        policy.terminate()
        assert await policy.wait() == 0, (tmp_path / "policy.log").read_text()


async def _first(events: Callable[[], Any], pod: str, reason: str) -> dict[str, Any] | None:
    for event in await events():
        if event["involvedObject"]["name"] == pod and event["reason"] == reason:
            return dict(event)
    return None
