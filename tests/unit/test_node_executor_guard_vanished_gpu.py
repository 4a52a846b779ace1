"""The memory guard only looks at GPUs still in the node's inventory.

A pod the log still places on a GPU the executor's inventory no longer has (the
node came back with fewer GPUs; the log's releases for the vanished GPU are not
folded yet) is skipped, whether its processes were started by a session or came
through the CUDA hook, and the guard goes on guarding the pods on the GPUs that
are left. Real child processes stand for the workloads (their pids are read from
/proc); the executor is not started: its decider loop is only the folded state the
guard reads.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from gpupool.core.state import PodState, State
from gpupool.events import GpuInfo, InventorySource, PodRef, Share
from gpupool.gpus import GpuSample, Inventory
from gpupool.node_executor.hooked_pods import HookedPod, RegisteredProcess
from gpupool.node_executor.memory_guard import GuardedWorkload, MemoryOverrun, guard_memory
from gpupool.node_executor.processes import Workload
from gpupool.node_executor.service import NodeExecutor, PodSession

NODE = "n1"
GIB = 1024**3
KEPT = GpuInfo(index=0, uuid="GPU-kept", memory_mib=81920)
VANISHED = GpuInfo(index=1, uuid="GPU-vanished", memory_mib=81920)
ON_KEPT, ON_VANISHED = PodRef(namespace="ns", name="on-kept"), PodRef(namespace="ns", name="gone")
HOOKED_KEPT = PodRef(namespace="ns", name="hooked-kept")
HOOKED_VANISHED = PodRef(namespace="ns", name="hooked-gone")


class OneRoundSampler:
    """Both GPUs' samples, every pid over any limit; stops the guard after one round."""

    def __init__(self, stop: asyncio.Event, pids: dict[str, list[int]]) -> None:
        self.stop = stop
        self.pids = pids

    @property
    def source(self) -> InventorySource:
        return "nvml"

    def sample(self) -> tuple[GpuSample, ...]:
        self.stop.set()
        return tuple(
            GpuSample(
                index=gpu.index,
                uuid=gpu.uuid,
                memory_used_bytes=0,
                memory_total_bytes=80 * GIB,
                utilisation=0.0,
                process_memory_bytes={pid: 79 * GIB for pid in self.pids[gpu.uuid]},
            )
            for gpu in (KEPT, VANISHED)
        )


def running_on(ref: PodRef, gpu: GpuInfo) -> PodState:
    return PodState(
        ref=ref,
        node=NODE,
        policy="share-pool",
        requests=Share(core=10, memory=10),
        limits=Share(core=50, memory=50),
        priority=0,
        uid=f"uid-{ref.name}",
        registered_at=datetime(2026, 1, 1, tzinfo=UTC),
        phase="running",
        gpu_index=gpu.index,
        gpu_uuid=gpu.uuid,
    )


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Four real processes, each the leader of its own session and process group."""
    started = [subprocess.Popen(["sleep", "120"], start_new_session=True) for _ in range(4)]
    yield started
    for process in started:
        process.kill()
        process.wait()


def executor_with_a_vanished_gpu(tmp_path: Path, pids: list[int]) -> NodeExecutor:
    executor = NodeExecutor(
        node=NODE,
        inventory=Inventory(gpus=(KEPT,), source="nvml"),
        socket_path=tmp_path / "executor.sock",
        sampler=OneRoundSampler(asyncio.Event(), {}),
    )
    state = State()
    for ref, gpu in [
        (ON_KEPT, KEPT),
        (ON_VANISHED, VANISHED),
        (HOOKED_KEPT, KEPT),
        (HOOKED_VANISHED, VANISHED),
    ]:
        state.pods[ref] = running_on(ref, gpu)
    executor._loop = cast(Any, SimpleNamespace(projection=SimpleNamespace(state=state)))
    for ref, pid in zip([ON_KEPT, ON_VANISHED], pids[:2], strict=True):
        executor._sessions[ref] = PodSession(pod=ref, workload=Workload(ref, pid))
    for ref, pid in zip([HOOKED_KEPT, HOOKED_VANISHED], pids[2:], strict=True):
        executor.hooked._pods[ref] = HookedPod(
            pod=ref, processes=[RegisteredProcess(pid, os.pidfd_open(pid))]
        )
    return executor


def test_pods_on_a_vanished_gpu_are_not_guarded_and_the_others_are(
    tmp_path: Path, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    pids = [process.pid for process in sleepers]
    executor = executor_with_a_vanished_gpu(tmp_path, pids)
    guarded = executor._guarded_workloads()
    assert sorted(guarded, key=lambda w: w.pod.name) == [
        GuardedWorkload(
            pod=HOOKED_KEPT,
            gpu_uuid=KEPT.uuid,
            memory_limit_bytes=40 * GIB,
            pids=frozenset({pids[2]}),
        ),
        GuardedWorkload(
            pod=ON_KEPT,
            gpu_uuid=KEPT.uuid,
            memory_limit_bytes=40 * GIB,
            pids=frozenset({pids[0]}),
            leader=pids[0],  # its group's other members are found among the sampled pids
        ),
    ]


async def test_the_guard_loop_ends_overruns_on_the_kept_gpu_only(
    tmp_path: Path, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    pids = [process.pid for process in sleepers]
    executor = executor_with_a_vanished_gpu(tmp_path, pids)
    stop = asyncio.Event()
    sampler = OneRoundSampler(
        stop, {KEPT.uuid: [pids[0], pids[2]], VANISHED.uuid: [pids[1], pids[3]]}
    )
    found: list[MemoryOverrun] = []

    async def on_overrun(overrun: MemoryOverrun) -> None:
        found.append(overrun)

    async with asyncio.timeout(10):
        await guard_memory(
            sampler, executor._guarded_workloads, on_overrun, period_seconds=0.01, stop=stop
        )
    assert sorted((o.pod, o.gpu_uuid) for o in found) == sorted(
        [(HOOKED_KEPT, KEPT.uuid), (ON_KEPT, KEPT.uuid)]
    )


def test_a_pods_processes_among_sampled_pids_are_found_by_their_group(
    tmp_path: Path, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    """The metrics' question, asked of a sample's pids: each command's own, by its group."""
    pids = [process.pid for process in sleepers]
    executor = executor_with_a_vanished_gpu(tmp_path, pids)
    processes = executor.pod_processes(among={pids[0], pids[1], pids[2]})
    assert processes[ON_KEPT] == [pids[0]]
    assert processes[ON_VANISHED] == [pids[1]]
    assert processes[HOOKED_KEPT] == [pids[2]]  # followed by its pidfd
    assert executor.pod_processes(among=set())[ON_KEPT] == []
    assert executor.pod_processes()[ON_KEPT] == [pids[0]]  # the full answer, as before
