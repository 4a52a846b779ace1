"""Preemption of a pod whose own processes hold the GPU through the CUDA hook: only those
processes end (SIGTERM), a process of the same pod that never touched CUDA lives on, the pod is
dormant, and its next cuInit queues behind the pods already waiting."""

from __future__ import annotations

import signal
from pathlib import Path

from cuda_hook_harness import start_hooked, visible_devices_at_init
from stack_harness import envelopes, of_type, read_log, running_stack, wait_for_log

from gpupool.events import Assigned, Preempted, Released

NODE = "node-1"
GPU = "GPU-SIMULATED-node-1-0"
CLUSTER = """
nodes:
  - name: node-1
    gpus: 1
    qos: '{"preemptEnabled": true, "preemptGracePeriodSeconds": 1}'
pods:
  - {name: low, node: node-1, priority: 0, requests: {core: 25, memory: 25}, limits: {core: 100, memory: 100}}
  - {name: mid, node: node-1, priority: 0, requests: {core: 25, memory: 25}, limits: {core: 100, memory: 100}}
  - {name: high, node: node-1, priority: 10, requests: {core: 25, memory: 25}, limits: {core: 100, memory: 100}}
"""


async def test_preemption_ends_only_the_gpu_processes_and_the_pods_next_cuinit_queues_again(
    tmp_path: Path,
) -> None:
    driver_log = tmp_path / "driver.log"
    async with running_stack(tmp_path, CLUSTER, NODE, gpus=1) as stack:
        socket = stack.socket_path
        low_gpu = await start_hooked(socket, "low", ["init", "wait"], driver_log=driver_log)
        await low_gpu.until_stdout("waiting")
        # the same pod's other process (a notebook server, say): the hook is loaded, CUDA unused
        low_idle = await start_hooked(
            socket, "low", ["wait"], driver_log=driver_log, name="low-idle"
        )
        await low_idle.until_stdout("waiting")

        high = await start_hooked(
            socket, "high", ["init", "wait"], driver_log=driver_log, route="procaddress"
        )
        assert await low_gpu.exit_code() == -signal.SIGTERM  # ended by the executor
        await high.until_stdout("cuInit 0")
        assert low_idle.process.returncode is None  # never touched CUDA: still alive
        await wait_for_log(stack, lambda log: bool(of_type(log, Released, "low")))

        mid = await start_hooked(socket, "mid", ["init", "wait"], driver_log=driver_log)
        await mid.until(lambda: bool(mid.waiting()), "mid's waiting line")
        low_again = await start_hooked(
            socket, "low", ["init", "wait"], driver_log=driver_log, program="python"
        )
        await low_again.until(lambda: bool(low_again.waiting()), "low's waiting line")
        assert all(position == 2 for _, position in low_again.waiting())  # behind mid
        assert low_idle.process.returncode is None

        await high.go_on()
        assert await high.exit_code() == 0
        await mid.until_stdout("cuInit 0")
        await mid.go_on()
        assert await mid.exit_code() == 0
        await low_again.until_stdout("cuInit 0")
        for process in (low_again, low_idle):
            await process.go_on()
            assert await process.exit_code() == 0
        await wait_for_log(stack, lambda log: len(of_type(log, Released)) >= 4)
        log = envelopes(await read_log(stack))

    preempted = of_type(log, Preempted)
    assert [(e.event.victim.name, e.event.preemptor.name) for e in preempted] == [("low", "high")]
    assert [e.event.reason for e in of_type(log, Released, "low")] == ["preempted", "completed"]
    assert [e.event.pod.name for e in of_type(log, Assigned)] == ["low", "high", "mid", "low"]
    assert visible_devices_at_init(driver_log, low_gpu.pid) == [GPU]
    assert visible_devices_at_init(driver_log, low_again.pid) == [GPU]
    assert visible_devices_at_init(driver_log, low_idle.pid) == []
