"""The worked example with four real, unwrapped processes as pods A–D: each becomes ready in its
own first cuInit (the CUDA hook), none runs under `gpupool run`. Real nats-server, the four
services as processes, two simulated GPUs, the fake CUDA driver recording what each saw."""

from __future__ import annotations

from pathlib import Path

from cuda_hook_harness import HookedProcess, Program, Route, start_hooked, visible_devices_at_init
from stack_harness import envelopes, of_type, read_log, running_stack, wait_for_log

from gpupool.cli.demo import EXPECTED_ASSIGNMENTS, NODE
from gpupool.events import Assigned, PodReady, Released

ROOT = Path(__file__).resolve().parents[2]

PODS: dict[str, tuple[Program, Route]] = {
    "pod-a": ("c", "dlsym"),
    "pod-c": ("python", "procaddress"),
    "pod-d": ("c", "procaddress"),
    "pod-b": ("python", "dlsym"),
}
"""Each pod a different program and way to the driver: C and Python, dlsym and cuGetProcAddress."""


def gpu_uuid(index: int) -> str:
    return f"GPU-SIMULATED-{NODE}-{index}"


async def test_four_unwrapped_processes_queue_and_run_as_the_worked_example_says(
    tmp_path: Path,
) -> None:
    driver_log = tmp_path / "driver.log"
    cluster = (ROOT / "scenarios" / "worked-example.yaml").read_text()
    processes: dict[str, HookedProcess] = {}
    async with running_stack(tmp_path, cluster, NODE, gpus=2) as stack:

        async def start(pod: str) -> HookedProcess:
            program, route = PODS[pod]
            processes[pod] = await start_hooked(
                stack.socket_path,
                pod,
                ["init", "wait"],
                driver_log=driver_log,
                program=program,
                route=route,
            )
            return processes[pod]

        a = await start("pod-a")
        await a.until_stdout("cuInit 0")
        c = await start("pod-c")
        await c.until_stdout("cuInit 0")
        d = await start("pod-d")
        await wait_for_log(stack, lambda log: bool(of_type(log, PodReady, "pod-d")))
        b = await start("pod-b")
        # T1: D waits at the head, B behind it, both blocked inside cuInit
        await d.until(lambda: bool(d.waiting()), "D's waiting line")
        await b.until(lambda: bool(b.waiting()), "B's waiting line")
        assert "cuInit 0" not in d.stdout and "cuInit 0" not in b.stdout
        # T2: C's process exits; its GPU is released, D gets GPU 1, then B GPU 0 beside A
        await c.go_on()
        assert await c.exit_code() == 0
        await d.until_stdout("cuInit 0")
        await b.until_stdout("cuInit 0")
        for pod in ("pod-a", "pod-d", "pod-b"):
            await processes[pod].go_on()
            assert await processes[pod].exit_code() == 0
        log = await wait_for_log(stack, lambda log: len(of_type(log, Released)) >= 4)
        log = envelopes(await read_log(stack))

    assigned = [(e.event.pod.name, e.event.gpu_index) for e in of_type(log, Assigned)]
    assert assigned == EXPECTED_ASSIGNMENTS
    # every process's real cuInit saw exactly its assigned GPU's UUID, and only once
    for pod, index in EXPECTED_ASSIGNMENTS:
        assert visible_devices_at_init(driver_log, processes[pod].pid) == [gpu_uuid(index)], pod
    # the waiting lines carry the true positions (D the head, B behind it) and true seconds
    assert d.waiting() and all(position == 1 for _, position in d.waiting())
    assert b.waiting() and all(position == 2 for _, position in b.waiting())
    for pod, process in (("pod-d", d), ("pod-b", b)):
        waited = (
            of_type(log, Assigned, pod)[0].time - of_type(log, PodReady, pod)[0].time
        ).total_seconds()
        assert all(seconds <= waited + 1 for seconds, _ in process.waiting()), (pod, waited)
    # C's exit released its GPU: Released(completed) before D's Assigned
    released_c = of_type(log, Released, "pod-c")
    assert [e.event.reason for e in released_c] == ["completed"]
    assert log.index(released_c[0]) < log.index(of_type(log, Assigned, "pod-d")[0])
    assert {e.event.pod.name: e.event.reason for e in of_type(log, Released)} == {
        "pod-a": "completed",
        "pod-b": "completed",
        "pod-c": "completed",
        "pod-d": "completed",
    }
