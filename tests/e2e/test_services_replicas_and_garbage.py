"""Two admission-queue replicas at once never commit two Assigned for the same capacity;
garbage on an event subject stops no service: it is set aside once, with its reason."""

from __future__ import annotations

import asyncio
import io
from datetime import UTC, datetime
from pathlib import Path

import nats
from stack_harness import envelopes, of_type, read_log, running_stack, wait_for_log

from gpupool.cli.demo import EXPECTED_ASSIGNMENTS, NODE, DemoRun, run_worked_example
from gpupool.cli.local_stack import http_get
from gpupool.core import (
    ConfigureNode,
    PodManifest,
    RegisterPod,
    ReportInventory,
    RequestGpu,
    Schedule,
)
from gpupool.core.validation import (
    COMPUTE_CLASS_LABEL,
    CORE_RESOURCE,
    MEMORY_RESOURCE,
    POLICY_LABEL,
    ContainerResources,
)
from gpupool.eventlog.jetstream import JetStreamEventLog
from gpupool.events import Assigned, GpuInfo, MessageRejected, PodRef
from gpupool.runtime.decider import DeciderLoop

ROOT = Path(__file__).resolve().parents[2]
NOW = datetime(2025, 1, 1, tzinfo=UTC)


def manifest(name: str) -> PodManifest:
    return PodManifest(
        namespace="default",
        name=name,
        node="n1",
        labels={COMPUTE_CLASS_LABEL: "gpu-hpn", POLICY_LABEL: "share-pool"},
        containers=(
            ContainerResources(
                name="main",
                requests={CORE_RESOURCE: 50, MEMORY_RESOURCE: 50},
                limits={CORE_RESOURCE: 100, MEMORY_RESOURCE: 100},
            ),
        ),
    )


async def test_two_deciders_racing_on_one_gpu_commit_one_assignment(
    jetstream_log: JetStreamEventLog,
) -> None:
    """Both replicas decide from the same state at the same moment; the log takes one decision."""
    setup = DeciderLoop(jetstream_log, service="setup", clock=lambda: NOW)
    await setup.execute(
        ReportInventory(
            node="n1", gpus=(GpuInfo(index=0, uuid="GPU-0", memory_mib=1),), source="simulated"
        ),
        node="n1",
    )
    await setup.execute(ConfigureNode(node="n1", policy_label="share-pool", gpu_count=1), node="n1")
    for name in ("x", "y"):
        await setup.execute(RegisterPod(manifest=manifest(name)), node="n1")
        await setup.execute(
            RequestGpu(pod=PodRef(namespace="default", name=name), node="n1"), node="n1"
        )

    first = DeciderLoop(jetstream_log, service="admission-1", clock=lambda: NOW)
    second = DeciderLoop(jetstream_log, service="admission-2", clock=lambda: NOW)
    await first.rebuild()
    await second.rebuild()
    results = await asyncio.gather(
        first.execute(Schedule(node="n1"), node="n1"),
        second.execute(Schedule(node="n1"), node="n1"),
    )
    assigned = [e async for e in jetstream_log.replay()]
    assignments = [
        e.envelope.event
        for e in assigned
        if isinstance(getattr(e, "envelope", None) and e.envelope.event, Assigned)
    ]
    assert len(assignments) == 1, "two replicas committed two Assigned for one GPU's capacity"
    assert sorted(len(r) for r in results) == [0, 1]
    assert first.conflicts + second.conflicts == 1


async def test_two_admission_queue_replicas_run_the_worked_example(tmp_path: Path) -> None:
    cluster = (ROOT / "scenarios" / "worked-example.yaml").read_text()
    async with running_stack(tmp_path, cluster, NODE, gpus=2) as stack:
        await stack.start_replica("admission-queue", "second")
        run = DemoRun(stack=stack, out=io.StringIO())
        assignments = await run_worked_example(run)
        log = envelopes(await read_log(stack))
    assert assignments == EXPECTED_ASSIGNMENTS
    assert len(of_type(log, Assigned)) == 4


async def test_garbage_on_an_event_subject_is_set_aside_and_nothing_stops(tmp_path: Path) -> None:
    cluster = (ROOT / "scenarios" / "worked-example.yaml").read_text()
    async with running_stack(tmp_path, cluster, NODE, gpus=2) as stack:
        nc = await nats.connect(stack.nats_url)
        try:
            js = nc.jetstream()
            token = NODE.replace(".", "_")
            first = await js.publish(f"gpupool.log.{token}.PodReady", b"\x00\xffnot json")
            second = await js.publish(f"gpupool.log.{token}.Assigned", b'{"id": 1, "event": "?"}')
        finally:
            await nc.close()
        log = await wait_for_log(stack, lambda log: len(of_type(log, MessageRejected)) >= 2)
        for name, service in stack.services.items():
            assert service.running, f"{name} stopped on garbage"
            status, _ = await http_get(service.port, "/readyz")
            assert status == 200, f"{name} is not ready after garbage"
        # the system still works
        run = DemoRun(stack=stack, out=io.StringIO())
        assert await run_worked_example(run) == EXPECTED_ASSIGNMENTS
        log = envelopes(await read_log(stack))
    rejected = of_type(log, MessageRejected)
    assert sorted(e.id for e in rejected) == sorted(
        [f"rejected-{first.seq}", f"rejected-{second.seq}"]
    )
    reasons = {e.event.subject: e.event.reason for e in rejected}
    assert reasons[f"gpupool.log.{token}.PodReady"].startswith("not a gpupool envelope")
    assert "invalid envelope" in reasons[f"gpupool.log.{token}.Assigned"]
