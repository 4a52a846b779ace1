"""Preemption through the services: a real process holding the GPU is ended (SIGTERM,
then SIGKILL because it ignores SIGTERM), the victim returns to dormant, the waiter runs,
and the log holds Preempted, then Released(preempted), then the waiter's Assigned."""

from __future__ import annotations

import sys
from pathlib import Path

from stack_harness import envelopes, of_type, read_log, running_stack, start_workload

from gpupool.core import fold
from gpupool.events import Assigned, PodReady, PodRef, Preempted, Released
from gpupool.workload.messages import EXIT_PREEMPTED

NODE = "node-1"
CLUSTER = """
nodes:
  - name: node-1
    gpus: 1
    qos: '{"preemptEnabled": true, "preemptGracePeriodSeconds": 1}'
pods:
  - {name: low, node: node-1, priority: 0, requests: {core: 50, memory: 50}, limits: {core: 100, memory: 100}}
  - {name: high, node: node-1, priority: 10, requests: {core: 50, memory: 50}, limits: {core: 100, memory: 100}}
"""

STUBBORN = (
    "import os, signal, subprocess, sys\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import signal, sys; "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); sys.stdin.read()'])\n"
    "print('pids', os.getpid(), child.pid, flush=True)\n"
    "child.wait()\n"
)
"""Ignores SIGTERM, and so does the child it forks: only SIGKILL to the group ends them."""


def alive(pid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return False
    return fields[0] != "Z"


async def test_preemption_kills_the_victims_processes_and_runs_the_waiter(tmp_path: Path) -> None:
    async with running_stack(tmp_path, CLUSTER, NODE, gpus=1) as stack:
        low = await start_workload(stack, "low", command=[sys.executable, "-c", STUBBORN])
        pids_line = await low.until_line(lambda line: line.startswith("pids "))
        pids = [int(p) for p in pids_line.split()[1:]]
        assert all(alive(pid) for pid in pids)

        high = await start_workload(stack, "high")
        await high.until_line(lambda line: line.startswith("running on"))
        assert await low.exit_code() == EXIT_PREEMPTED
        assert "GPU is preempted by high." in low.lines
        assert not any(alive(pid) for pid in pids), "the victim's processes survived"
        assert await high.finish() == 0
        log = envelopes(await read_log(stack))

    preempted = of_type(log, Preempted)
    assert len(preempted) == 1
    event = preempted[0].event
    assert (event.victim.name, event.preemptor.name, event.reason, event.gpu_index) == (
        "low",
        "high",
        "priority",
        0,
    )
    order = [
        (type(e.event).__name__, getattr(e.event, "reason", None))
        for e in log
        if isinstance(e.event, Preempted | Released | Assigned)
        and (e.event.victim.name if isinstance(e.event, Preempted) else e.event.pod.name)
        in ("low", "high")
    ]
    assert order == [
        ("Assigned", None),  # low
        ("Preempted", "priority"),
        ("Released", "preempted"),  # low, after its processes were confirmed gone
        ("Assigned", None),  # high
        ("Released", "completed"),  # high
    ]
    released = of_type(log, Released, "low")[0].event
    assert released.exit_code == 137  # SIGKILL: it ignored SIGTERM
    state = fold(log)
    assert state.pods[PodRef(namespace="default", name="low")].phase == "dormant"


async def test_a_preempted_workload_with_requeue_queues_again_and_runs_after_the_preemptor(
    tmp_path: Path,
) -> None:
    async with running_stack(tmp_path, CLUSTER, NODE, gpus=1) as stack:
        low = await start_workload(stack, "low", extra=["--requeue"])
        await low.until_line(lambda line: line.startswith("running on"))
        high = await start_workload(stack, "high")
        await high.until_line(lambda line: line.startswith("running on"))
        await low.until_line(lambda line: line == "GPU is preempted by high.")
        # low is back in the queue, behind nobody but blocked by high's limit of 100
        await low.until_line(lambda line: line.endswith("Approximate position: 1"))
        assert await high.finish() == 0
        # the command runs a second time, on the GPU high gave back
        await low.until_line(lambda _: low.lines.count("running on GPU-SIMULATED-node-1-0") == 2)
        assert await low.finish() == 0
        log = envelopes(await read_log(stack))
    low_events = [
        (type(e.event).__name__, getattr(e.event, "reason", None))
        for e in log
        if (
            e.event.victim.name
            if isinstance(e.event, Preempted)
            else getattr(e.event, "pod", PodRef(namespace="", name="")).name
        )
        == "low"
        and isinstance(e.event, PodReady | Assigned | Preempted | Released)
    ]
    assert low_events == [
        ("PodReady", None),
        ("Assigned", None),
        ("Preempted", "priority"),
        ("Released", "preempted"),
        ("PodReady", None),
        ("Assigned", None),
        ("Released", "completed"),
    ]
