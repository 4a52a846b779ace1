"""The CUDA hook enforces the pod's memory limit as CUDA_ERROR_OUT_OF_MEMORY (across the pod's
processes), reports the limit through cuMemGetInfo, and fails closed: no executor, or a refusal,
and cuInit fails with one clear line while nothing reaches the GPU."""

from __future__ import annotations

from pathlib import Path

from cuda_hook_harness import driver_calls, start_hooked
from stack_harness import envelopes, of_type, read_log, running_stack, wait_for_log

from gpupool.events import PodRejected, Released

NODE = "node-1"
MIB = 1024 * 1024
GPU_MIB = 81559  # the simulated GPU's memory
LIMIT = GPU_MIB * 25 // 100 * MIB  # pod "small": gpu-memory limit 25 %
CLUSTER = """
nodes:
  - name: node-1
    gpus: 1
pods:
  - {name: small, node: node-1, requests: {core: 25, memory: 25}, limits: {core: 25, memory: 25}}
"""
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_NO_DEVICE = 100


def allocations(calls: list[str]) -> list[int]:
    return [
        int(call.split("bytes=")[1].split()[0]) for call in calls if call.startswith("cuMemAlloc")
    ]


async def test_allocations_past_the_pods_limit_fail_with_out_of_memory_and_the_process_goes_on(
    tmp_path: Path,
) -> None:
    driver_log = tmp_path / "driver.log"
    half, too_much = LIMIT // 2, LIMIT // 2 + MIB
    steps_of_first = [
        *("init", "info", f"alloc:{half}", f"alloc:{too_much}", f"alloc:{MIB}", "free"),
        *("info", "wait"),
    ]
    async with running_stack(tmp_path, CLUSTER, NODE, gpus=1) as stack:
        first = await start_hooked(
            stack.socket_path,
            "small",
            steps_of_first,
            driver_log=driver_log,
            program="c",
            route="procaddress",
        )
        await first.until_stdout("waiting")
        # a second process of the same pod shares the pod's limit: half of it is taken
        second = await start_hooked(
            stack.socket_path,
            "small",
            ["init", f"alloc:{LIMIT - half + 1}", f"alloc:{LIMIT - half}", "info"],
            driver_log=driver_log,
            program="python",
            route="dlsym",
            env={"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)},  # as if an MPS daemon served it
        )
        assert await second.exit_code() == 0, second.stderr
        await first.go_on()
        assert await first.exit_code() == 0, first.stderr
        await wait_for_log(stack, lambda log: bool(of_type(log, Released, "small")))

    assert first.stdout == [
        "cuInit 0",
        f"cuMemGetInfo 0 free={LIMIT} total={LIMIT}",  # the limit is the total
        f"cuMemAlloc {half} 0",
        f"cuMemAlloc {too_much} {CUDA_ERROR_OUT_OF_MEMORY}",  # would pass the limit: refused
        f"cuMemAlloc {MIB} 0",  # the process goes on; smaller ones still reach the driver
        "cuMemFree 0",
        f"cuMemGetInfo 0 free={LIMIT - half} total={LIMIT}",
        "waiting",
    ]
    assert second.stdout == [
        "cuInit 0",
        f"cuMemAlloc {LIMIT - half + 1} {CUDA_ERROR_OUT_OF_MEMORY}",  # the pod's total counts
        f"cuMemAlloc {LIMIT - half} 0",
        f"cuMemGetInfo 0 free=0 total={LIMIT}",
    ]
    # the MPS client limits are set only where an MPS daemon serves the process
    (first_init,) = [c for c in driver_calls(driver_log, first.pid) if c.startswith("cuInit")]
    (second_init,) = [c for c in driver_calls(driver_log, second.pid) if c.startswith("cuInit")]
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=<unset>" in first_init
    assert (
        f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={LIMIT // MIB}M"
        in second_init
    )
    # the refused allocations never reached the driver; the others did
    assert allocations(driver_calls(driver_log, first.pid)) == [half, MIB]
    assert allocations(driver_calls(driver_log, second.pid)) == [LIMIT - half]


async def test_thousands_of_allocations_are_counted_and_all_given_back(tmp_path: Path) -> None:
    """The hook's table of live allocations grows, and frees return every byte to the pod."""
    driver_log = tmp_path / "driver.log"
    count = 3000
    async with running_stack(tmp_path, CLUSTER, NODE, gpus=1) as stack:
        process = await start_hooked(
            stack.socket_path,
            "small",
            ["init", *[f"alloc:{MIB}"] * count, "info", "free-all", "info"],
            driver_log=driver_log,
            program="c",
        )
        assert await process.exit_code() == 0, process.stderr
    assert process.stdout == [
        "cuInit 0",
        f"cuMemGetInfo 0 free={LIMIT - count * MIB} total={LIMIT}",
        f"cuMemFree-all {count} 0",
        f"cuMemGetInfo 0 free={LIMIT} total={LIMIT}",
    ]
    calls = driver_calls(driver_log, process.pid)
    assert allocations(calls) == [MIB] * count
    assert sum(
        call.startswith("cuMemFree_v2 ") and call.endswith("result=0") for call in calls
    ) == (count)


async def test_without_an_executor_cuinit_fails_with_one_clear_line_and_nothing_reaches_the_gpu(
    tmp_path: Path,
) -> None:
    driver_log = tmp_path / "driver.log"
    socket = tmp_path / "no-executor.sock"
    for program in ("c", "python"):
        process = await start_hooked(
            socket,
            "small",
            ["init", f"alloc:{MIB}"],
            driver_log=driver_log,
            program=program,  # type: ignore[arg-type]
        )
        assert await process.exit_code() == 0
        assert process.stdout == [
            f"cuInit {CUDA_ERROR_NO_DEVICE}",
            f"cuMemAlloc {MIB} {CUDA_ERROR_NOT_INITIALIZED}",
        ]
        assert process.stderr == [
            f"gpupool: cannot reach the node-executor at {socket} (No such file or directory); "
            "this process gets no GPU"
        ]
        assert driver_calls(driver_log, process.pid) == []  # the real cuInit never ran


async def test_a_pod_the_core_refuses_gets_no_gpu_and_its_cuinit_says_why(tmp_path: Path) -> None:
    driver_log = tmp_path / "driver.log"
    async with running_stack(tmp_path, CLUSTER, NODE, gpus=1) as stack:
        process = await start_hooked(
            stack.socket_path, "not-registered", ["init"], driver_log=driver_log
        )
        assert await process.exit_code() == 0
        await wait_for_log(stack, lambda log: bool(of_type(log, PodRejected)))
        log = envelopes(await read_log(stack))
    assert process.stdout == [f"cuInit {CUDA_ERROR_NO_DEVICE}"]
    rejected = of_type(log, PodRejected)[0].event
    assert rejected.reason == "UnknownPod"
    assert process.stderr == [
        f"gpupool: the node-executor refused this process a GPU (UnknownPod): {rejected.message}"
    ]
    assert driver_calls(driver_log, process.pid) == []
