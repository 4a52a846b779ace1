"""Ending workloads that hold more GPU memory than their pod's limit (recorded as out-of-memory).

:func:`find_memory_overruns` is pure: samples and workloads in, overruns out. :func:`guard_memory`
is the thin loop around it. A simulated sampler reports no per-process memory, so nothing is
ever found over its limit there: the guard is inert without NVML, and says so.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

import msgspec

from gpupool.events import PodRef
from gpupool.gpus import GpuSample, GpuSampler, SamplingFailed
from gpupool.node_executor.processes import process_groups

log = logging.getLogger(__name__)


class GuardedWorkload(msgspec.Struct, frozen=True, kw_only=True):
    """A running pod: its GPU, its memory limit and the pids of its workload's process group."""

    pod: PodRef
    gpu_uuid: str
    memory_limit_bytes: int
    pids: frozenset[int]
    leader: int = 0
    """A command's session leader (0: none): the sampled processes in its group or session
    are its too (:func:`guard_memory` asks, for the pids a sample names only)."""


class MemoryOverrun(msgspec.Struct, frozen=True, kw_only=True):
    pod: PodRef
    gpu_uuid: str
    used_bytes: int
    limit_bytes: int
    pids: tuple[int, ...]
    """The workload's pids that hold memory on the GPU."""


def find_memory_overruns(
    samples: Sequence[GpuSample], workloads: Sequence[GuardedWorkload]
) -> list[MemoryOverrun]:
    """Workloads whose processes together hold more than their limit on their GPU."""
    by_uuid = {sample.uuid: sample for sample in samples}
    overruns = []
    for workload in workloads:
        sample = by_uuid.get(workload.gpu_uuid)
        if sample is None:
            continue
        holding = {
            pid: used for pid, used in sample.process_memory_bytes.items() if pid in workload.pids
        }
        used = sum(holding.values())
        if used > workload.memory_limit_bytes:
            overruns.append(
                MemoryOverrun(
                    pod=workload.pod,
                    gpu_uuid=workload.gpu_uuid,
                    used_bytes=used,
                    limit_bytes=workload.memory_limit_bytes,
                    pids=tuple(sorted(holding)),
                )
            )
    return overruns


def _with_sampled_members(
    workload: GuardedWorkload, groups: dict[int, tuple[int, int]]
) -> GuardedWorkload:
    """The workload with the sampled processes of its leader's group or session added."""
    if workload.leader <= 0:
        return workload
    members = {pid for pid, ids in groups.items() if workload.leader in ids}
    if members <= workload.pids:
        return workload
    return msgspec.structs.replace(workload, pids=workload.pids | members)


async def guard_memory(
    sampler: GpuSampler,
    running: Callable[[], Sequence[GuardedWorkload]],
    on_overrun: Callable[[MemoryOverrun], Awaitable[None]],
    *,
    period_seconds: float,
    stop: asyncio.Event,
) -> None:
    """Every ``period_seconds`` until ``stop``: sample (in a thread), compare, report overruns.

    ``running`` is asked afresh each round (pids come and go); ``on_overrun`` ends the pod's
    processes and records the release as out-of-memory. A failed sample is logged and skipped.
    """
    if sampler.source == "simulated":
        log.warning("memory guard inert: SIMULATED GPUs report no per-process memory")
    while not stop.is_set():
        workloads = running()
        if workloads:
            try:
                samples = await asyncio.to_thread(sampler.sample)
            except SamplingFailed as error:
                log.warning("GPU sampling failed, memory not checked this round: %s", error)
            else:
                sampled = {pid for sample in samples for pid in sample.process_memory_bytes}
                if sampled and any(w.leader > 0 for w in workloads):
                    groups = process_groups(sampled)  # one stat read per sampled pid
                    workloads = [_with_sampled_members(w, groups) for w in workloads]
                for overrun in find_memory_overruns(samples, workloads):
                    log.warning(
                        "pod %s holds %d bytes on %s, over its limit of %d: ending it",
                        overrun.pod,
                        overrun.used_bytes,
                        overrun.gpu_uuid,
                        overrun.limit_bytes,
                    )
                    await on_overrun(overrun)
        try:
            async with asyncio.timeout(period_seconds):
                await stop.wait()
        except TimeoutError:
            pass
