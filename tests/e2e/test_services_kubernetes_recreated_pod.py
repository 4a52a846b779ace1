"""The policy service process in Kubernetes mode (kmock for the API, a real JetStream): a pod
recreated under the name of a deleted pod still releasing its GPU is refused with
PreviousPodReleasing, and registered, once, after the old pod's Released is in the log.

The other services' commands (the executor's inventory, request and release, the
admission queue's schedule) are decided here against the same log, as those services
would append them.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import kmock
import pytest
from stack_harness import follow_log

from gpupool.core import Command, ReportInventory, ReportRelease, RequestGpu, Schedule
from gpupool.eventlog.jetstream import JetStreamEventLog
from gpupool.eventlog.nats_server import run_nats_server
from gpupool.eventlog.port import StoredEvent
from gpupool.events import (
    Assigned,
    Envelope,
    GpuInfo,
    PodRef,
    PodRegistered,
    PodRejected,
    PodRemoved,
    Released,
)
from gpupool.runtime.decider import DeciderLoop

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from kube_harness import POLICY_LABEL, SOURCE_NODE, kubectl, node_object, share_pod

PODS = "/api/v1/namespaces/default/pods"
NAME = "train-0"
POD = PodRef(namespace="default", name=NAME)


@pytest.fixture
async def nats_server(tmp_path: Path) -> AsyncIterator[str]:
    async with run_nats_server(tmp_path / "nats") as url:
        yield url


def registrations(log: list[Envelope]) -> list[str]:
    return [e.event.uid for e in log if isinstance(e.event, PodRegistered) and e.event.pod == POD]


def refusals(log: list[Envelope]) -> list[str]:
    return [e.event.reason for e in log if isinstance(e.event, PodRejected) and e.event.pod == POD]


def has(kind: type) -> Callable[[list[Envelope]], bool]:
    return lambda log: any(isinstance(e.event, kind) and e.event.pod == POD for e in log)


async def decide_as(url: str, service: str, command: Command, node: str = SOURCE_NODE) -> None:
    log = await JetStreamEventLog.connect(url)
    try:
        loop = DeciderLoop(log, service=service)
        await loop.rebuild()
        await loop.execute(command, node=node)
    finally:
        await log.close()


async def test_a_recreated_pod_registers_once_its_namesake_is_released(
    kmock: kmock.KubernetesEmulator, nats_server: str, tmp_path: Path
) -> None:
    await kubectl(kmock, "POST", "/api/v1/nodes", node_object(labels={POLICY_LABEL: "share-pool"}))
    await kubectl(kmock, "POST", PODS, share_pod(NAME, uid="uid-old"))
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
        await follow_log(nats_server, lambda log: registrations(log) == ["uid-old"])
        gpu = GpuInfo(index=0, uuid="GPU-8f3c", memory_mib=81920)
        inventory = ReportInventory(node=SOURCE_NODE, gpus=(gpu,), source="simulated")
        await decide_as(nats_server, "node-executor", inventory)
        await decide_as(nats_server, "node-executor", RequestGpu(pod=POD, node=SOURCE_NODE))
        await decide_as(nats_server, "admission-queue", Schedule(node=SOURCE_NODE))
        await follow_log(nats_server, has(Assigned))

        # deleted while it holds the GPU; recreated under its name with a new UID
        await kubectl(kmock, "DELETE", f"{PODS}/{NAME}")
        await follow_log(nats_server, has(PodRemoved))
        await kubectl(kmock, "POST", PODS, share_pod(NAME, uid="uid-new"))
        log = await follow_log(nats_server, lambda log: bool(refusals(log)))
        assert refusals(log) == ["PreviousPodReleasing"]
        assert registrations(log) == ["uid-old"]

        # the executor records the old pod's end: the policy service registers the new one
        ended = ReportRelease(pod=POD, node=SOURCE_NODE, reason="cancelled")
        await decide_as(nats_server, "node-executor", ended)
        log = await follow_log(nats_server, lambda log: len(registrations(log)) == 2)
        assert registrations(log) == ["uid-old", "uid-new"]
        assert [type(e.event) for e in log if isinstance(e.event, Released)] == [Released]
    finally:
        policy.terminate()
        assert await policy.wait() == 0, (tmp_path / "policy.log").read_text()

    # the whole log, read after the service stopped: one refusal, two registrations
    reader = await JetStreamEventLog.connect(nats_server)
    try:
        final = [e.envelope async for e in reader.replay() if isinstance(e, StoredEvent)]
    finally:
        await reader.close()
    assert registrations(final) == ["uid-old", "uid-new"]
    assert refusals(final) == ["PreviousPodReleasing"]
