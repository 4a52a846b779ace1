"""The memory guard: which pods hold more GPU memory than their limit, and the loop around it."""

from __future__ import annotations

import asyncio

import pytest

from gpupool.events import InventorySource, PodRef
from gpupool.gpus import GpuSample, SamplingFailed
from gpupool.node_executor.memory_guard import (
    GuardedWorkload,
    MemoryOverrun,
    find_memory_overruns,
    guard_memory,
)

GIB = 1024**3
A = PodRef(namespace="ns", name="a")
B = PodRef(namespace="ns", name="b")


def card(uuid: str, **processes: int) -> GpuSample:
    return GpuSample(
        index=0,
        uuid=uuid,
        memory_used_bytes=sum(processes.values()),
        memory_total_bytes=80 * GIB,
        utilisation=0.5,
        process_memory_bytes={int(pid.removeprefix("p")): used for pid, used in processes.items()},
    )


def running(pod: PodRef, uuid: str, limit_gib: int, *pids: int) -> GuardedWorkload:
    return GuardedWorkload(
        pod=pod, gpu_uuid=uuid, memory_limit_bytes=limit_gib * GIB, pids=frozenset(pids)
    )


@pytest.mark.parametrize(
    ("samples", "workloads", "over"),
    [
        pytest.param([card("G0", p10=10 * GIB)], [running(A, "G0", 20, 10)], [], id="under"),
        pytest.param([card("G0", p10=20 * GIB)], [running(A, "G0", 20, 10)], [], id="exactly-at-limit"),
        pytest.param(
            [card("G0", p10=15 * GIB, p11=6 * GIB)], [running(A, "G0", 20, 10, 11)],
            [MemoryOverrun(pod=A, gpu_uuid="G0", used_bytes=21 * GIB, limit_bytes=20 * GIB, pids=(10, 11))],
            id="children-add-up",
        ),
        pytest.param(
            [card("G0", p10=15 * GIB, p20=30 * GIB)],
            [running(A, "G0", 20, 10), running(B, "G0", 40, 20)], [], id="neighbours-not-counted",
        ),
        pytest.param(
            [card("G0", p10=5 * GIB, p20=45 * GIB)],
            [running(A, "G0", 20, 10), running(B, "G0", 40, 20)],
            [MemoryOverrun(pod=B, gpu_uuid="G0", used_bytes=45 * GIB, limit_bytes=40 * GIB, pids=(20,))],
            id="only-the-offender",
        ),
        pytest.param(
            [card("G0"), card("G1", p10=50 * GIB)], [running(A, "G0", 20, 10)], [],
            id="other-gpu-is-not-the-pods",
        ),
        pytest.param([card("G0", p99=70 * GIB)], [running(A, "G0", 20, 10)], [], id="foreign-process"),
        pytest.param([], [running(A, "G0", 20, 10)], [], id="no-samples"),
    ],
)  # fmt: skip
def test_find_memory_overruns(
    samples: list[GpuSample], workloads: list[GuardedWorkload], over: list[MemoryOverrun]
) -> None:
    assert find_memory_overruns(samples, workloads) == over


class ScriptedSampler:
    """Returns the scripted samples in turn; a SamplingFailed in the script is raised."""

    def __init__(self, *script: tuple[GpuSample, ...] | SamplingFailed) -> None:
        self.script = list(script)
        self.calls = 0

    @property
    def source(self) -> InventorySource:
        return "nvml"

    def sample(self) -> tuple[GpuSample, ...]:
        self.calls += 1
        step = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        if isinstance(step, SamplingFailed):
            raise step
        return step


async def test_guard_loop_reports_overruns_and_survives_a_failed_sample() -> None:
    sampler = ScriptedSampler(
        (card("G0", p10=1 * GIB),),
        SamplingFailed("GPU is lost"),
        (card("G0", p10=30 * GIB),),
    )
    stop = asyncio.Event()
    found: list[MemoryOverrun] = []

    async def on_overrun(overrun: MemoryOverrun) -> None:
        found.append(overrun)
        stop.set()

    async with asyncio.timeout(10):
        await guard_memory(
            sampler,
            lambda: [running(A, "G0", 20, 10)],
            on_overrun,
            period_seconds=0.01,
            stop=stop,
        )
    assert sampler.calls == 3
    assert found == [
        MemoryOverrun(pod=A, gpu_uuid="G0", used_bytes=30 * GIB, limit_bytes=20 * GIB, pids=(10,))
    ]


async def test_guard_loop_does_not_sample_when_nothing_runs() -> None:
    sampler = ScriptedSampler((card("G0"),))
    stop = asyncio.Event()
    rounds = 0

    def nothing_running() -> list[GuardedWorkload]:
        nonlocal rounds
        rounds += 1
        if rounds == 3:
            stop.set()
        return []

    async def on_overrun(overrun: MemoryOverrun) -> None:
        raise AssertionError(overrun)

    async with asyncio.timeout(10):
        await guard_memory(sampler, nothing_running, on_overrun, period_seconds=0.01, stop=stop)
    assert rounds == 3
    assert sampler.calls == 0
