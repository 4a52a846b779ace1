"""docs/behaviour.md's worked example, live: real nats-server, the four services as
processes, four real `gpupool run` workloads on two simulated GPUs."""

from __future__ import annotations

import io
import re
from pathlib import Path

import nats
from stack_harness import envelopes, of_type, read_log, running_stack

from gpupool.cli.demo import EXPECTED_ASSIGNMENTS, NODE, DemoRun, run_worked_example
from gpupool.eventlog.subjects import node_subject_filter
from gpupool.events import Assigned, PodReady

ROOT = Path(__file__).resolve().parents[2]
WAITING = re.compile(r"^You have been waiting for (\d+) seconds\. Approximate position: (\d+)$")


async def durable_filters(url: str) -> dict[str, str | None]:
    """Each durable consumer of the log's stream, with its subject filter."""
    nc = await nats.connect(url)
    try:
        infos = await nc.jetstream().consumers_info("GPUPOOL")
        return {info.name: info.config.filter_subject for info in infos}
    finally:
        await nc.close()


async def test_worked_example_through_all_services(tmp_path: Path) -> None:
    cluster = (ROOT / "scenarios" / "worked-example.yaml").read_text()
    async with running_stack(tmp_path, cluster, NODE, gpus=2) as stack:
        run = DemoRun(stack=stack, out=io.StringIO())
        assignments = await run_worked_example(run)
        log = envelopes(await read_log(stack))
        filters = await durable_filters(stack.nats_url)

    # the node-executor's durable reads its own node's subjects only (docs/eventlog.md)
    executor = [name for name in filters if name.startswith("node-executor-")]
    assert len(executor) == 1, filters
    assert filters[executor[0]] == node_subject_filter(NODE)

    # the order of Assigned events and their GPUs is exactly the worked example's (docs/behaviour.md)
    assert assignments == EXPECTED_ASSIGNMENTS
    assert [
        (e.event.pod.name, e.event.gpu_index) for e in of_type(log, Assigned)
    ] == EXPECTED_ASSIGNMENTS

    # the waiting messages carry true positions: at T1 D is the head, B is behind it
    d_waiting = [WAITING.match(line) for line in run.waiting_lines("pod-d")]
    b_waiting = [WAITING.match(line) for line in run.waiting_lines("pod-b")]
    assert d_waiting and all(m is not None and m.group(2) == "1" for m in d_waiting)
    assert b_waiting and all(m is not None and m.group(2) == "2" for m in b_waiting)

    # ...and true seconds: never more than the time between PodReady and Assigned in the log
    for pod, lines in (("pod-d", d_waiting), ("pod-b", b_waiting)):
        ready = of_type(log, PodReady, pod)[0].time
        assigned = of_type(log, Assigned, pod)[0].time
        waited = (assigned - ready).total_seconds()
        assert all(m is not None and int(m.group(1)) <= waited + 1 for m in lines), (pod, waited)

    # every event recorded once
    assert len({e.id for e in log}) == len(log)
