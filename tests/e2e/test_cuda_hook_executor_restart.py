"""An executor crash loses no pod whose own processes hold the GPU: the restarted executor finds
the registered processes again (its records and the kernel), a new process of the pod joins the
same assignment, and the pod is released once, when the last of them ends."""

from __future__ import annotations

from pathlib import Path

from cuda_hook_harness import start_hooked, visible_devices_at_init
from stack_harness import envelopes, of_type, read_log, running_stack, wait_for_log

from gpupool.events import Assigned, PodReady, Released

NODE = "node-1"
GPU = "GPU-SIMULATED-node-1-0"
CLUSTER = """
nodes:
  - name: node-1
    gpus: 1
pods:
  - {name: trainer, node: node-1, requests: {core: 50, memory: 50}, limits: {core: 50, memory: 50}}
"""


async def test_a_crashed_executor_finds_the_pods_gpu_processes_again(tmp_path: Path) -> None:
    driver_log = tmp_path / "driver.log"
    async with running_stack(tmp_path, CLUSTER, NODE, gpus=1) as stack:
        first = await start_hooked(
            stack.socket_path, "trainer", ["init", "wait"], driver_log=driver_log
        )
        await first.until_stdout("waiting")
        assert first.stdout == ["cuInit 0", "waiting"], first.stderr
        await stack.kill("node-executor")
        await stack.restart("node-executor")
        # the process lives on, and the pod still runs: more processes join it at once, one
        # after the other; had the pod been released when one of them ended, the next would
        # queue again (a second PodReady and Assigned in the log)
        joined = []
        for program in ("python", "c"):
            process = await start_hooked(
                stack.socket_path, "trainer", ["init"], driver_log=driver_log, program=program
            )
            assert await process.exit_code() == 0
            assert process.stdout == ["cuInit 0"]
            assert process.waiting() == []
            joined.append(process)
        await first.go_on()
        assert await first.exit_code() == 0
        await wait_for_log(stack, lambda log: bool(of_type(log, Released, "trainer")))
        log = envelopes(await read_log(stack))

    assert len(of_type(log, PodReady, "trainer")) == 1
    assert len(of_type(log, Assigned, "trainer")) == 1
    assert [e.event.reason for e in of_type(log, Released, "trainer")] == ["completed"]
    for process in (first, *joined):
        assert visible_devices_at_init(driver_log, process.pid) == [GPU]
