"""kill -9 of each service in turn during the worked example: each restarts, rebuilds from
the log, and the run finishes with the worked example's assignments; no event lost, none duplicated.
The node-executor's crash is the hard one: the running commands survive under their shims
and are adopted, the waiting pods keep their places, and every client reattaches."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from stack_harness import (
    WAITING,
    envelopes,
    of_type,
    read_log,
    running_stack,
    start_workload,
    wait_for_log,
)

from gpupool.cli.demo import EXPECTED_ASSIGNMENTS, NODE
from gpupool.core import fold
from gpupool.events import Assigned, PodReady, PodRegistered, Released

ROOT = Path(__file__).resolve().parents[2]


def assigned(pod: str):
    return lambda log: bool(of_type(log, Assigned, pod))


async def test_kill_each_service_in_turn(tmp_path: Path) -> None:
    cluster = (ROOT / "scenarios" / "worked-example.yaml").read_text()
    async with running_stack(tmp_path, cluster, NODE, gpus=2) as stack:
        # policy: killed after registering; its restart re-reads the cluster file (no duplicates)
        await wait_for_log(stack, lambda log: len(of_type(log, PodRegistered)) == 4)
        await stack.kill("policy")
        await stack.restart("policy")

        a = await start_workload(stack, "pod-a")
        await wait_for_log(stack, assigned("pod-a"))

        # admission-queue: down while C becomes ready; its restart assigns C
        await stack.kill("admission-queue")
        c = await start_workload(stack, "pod-c")
        await wait_for_log(stack, lambda log: bool(of_type(log, PodReady, "pod-c")))
        await stack.restart("admission-queue")
        await wait_for_log(stack, assigned("pod-c"))

        # preemption: down while D and B queue
        await stack.kill("preemption")
        d = await start_workload(stack, "pod-d")
        await wait_for_log(stack, lambda log: bool(of_type(log, PodReady, "pod-d")))
        b = await start_workload(stack, "pod-b")
        await stack.restart("preemption")
        await b.until_line(lambda line: WAITING.match(line) is not None)

        # node-executor: killed while A and C run and D and B wait
        a_pid = int((await a.until_line(lambda line: "as pid" in line)).rsplit(" ", 1)[1])
        await stack.kill("node-executor")
        assert Path(f"/proc/{a_pid}").exists(), "A's command must survive the executor's crash"
        lines_before = len(b.lines)
        await stack.restart("node-executor")
        # the clients reattach: B keeps its place (position 2) under the new executor
        await b.until_line(
            lambda line: (
                line in b.lines[lines_before:]
                and (m := WAITING.match(line)) is not None
                and m.group(2) == "2"
            )
        )

        # T2: C's task completes (its command is the adopted one; its client is still there)
        assert await c.finish() == 0
        await wait_for_log(stack, lambda log: assigned("pod-d")(log) and assigned("pod-b")(log))
        for workload in (a, d, b):
            assert await workload.finish() == 0
        await wait_for_log(stack, lambda log: len(of_type(log, Released)) == 4)
        log = envelopes(await read_log(stack))

    assert [
        (e.event.pod.name, e.event.gpu_index) for e in of_type(log, Assigned)
    ] == EXPECTED_ASSIGNMENTS
    assert len({e.id for e in log}) == len(log), "an event was recorded twice"
    assert Counter(e.event.pod.name for e in of_type(log, PodRegistered)) == Counter(
        {"pod-a": 1, "pod-b": 1, "pod-c": 1, "pod-d": 1}
    )
    assert Counter(e.event.pod.name for e in of_type(log, PodReady)) == Counter(
        {"pod-a": 1, "pod-b": 1, "pod-c": 1, "pod-d": 1}
    ), "a reattaching client must not queue its pod again"
    releases = {
        e.event.pod.name: (e.event.reason, e.event.exit_code) for e in of_type(log, Released)
    }
    assert releases == {name: ("completed", 0) for name in ("pod-a", "pod-b", "pod-c", "pod-d")}
    state = fold(log)
    assert {pod.ref.name: pod.phase for pod in state.pods.values()} == {
        "pod-a": "dormant",
        "pod-b": "dormant",
        "pod-c": "dormant",
        "pod-d": "dormant",
    }
