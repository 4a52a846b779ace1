"""The environment a workload runs with: its one GPU, and its limits handed to CUDA (MPS)."""

from __future__ import annotations

from collections.abc import Mapping

from gpupool.events import GpuInfo, PodRef, Share

MIB = 1024 * 1024

CONTROLLED_PREFIXES = ("CUDA_MPS_",)
CONTROLLED_NAMES = frozenset({"CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"})
"""Variables the client may not set: they choose devices or loosen limits. The executor's win."""


def memory_limit_mib(gpu: GpuInfo, limits: Share) -> int:
    """``gpu-memory.percentage`` limit of this card, in whole MiB (floored)."""
    return gpu.memory_mib * limits.memory // 100


def memory_limit_bytes(gpu: GpuInfo, limits: Share) -> int:
    """The same limit in bytes (exactly what CUDA is told, so both agree)."""
    return memory_limit_mib(gpu, limits) * MIB


def workload_environment(
    base_env: Mapping[str, str],
    gpu: GpuInfo,
    limits: Share,
    *,
    pod: PodRef,
    mps_pipe_directory: str | None = None,
) -> dict[str, str]:
    """``base_env`` (the client's) with the GPU and the limits set.

    * ``CUDA_VISIBLE_DEVICES`` is the GPU's UUID, so the process sees that one card only, as
      CUDA device 0.
    * ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` is the core limit and
      ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` is ``0=<MiB>M`` (device 0 because CUDA renumbers
      the visible devices). They take effect where an MPS control daemon serves the node
      (``mps_pipe_directory``); without one CUDA ignores them and the memory guard enforces
      the memory limit.
    * ``GPUPOOL_POD``, ``GPUPOOL_GPU_INDEX`` (the node's real index) and ``GPUPOOL_GPU_UUID``.
    """
    env = {
        name: value
        for name, value in base_env.items()
        if name not in CONTROLLED_NAMES and not name.startswith(CONTROLLED_PREFIXES)
    }
    env["CUDA_VISIBLE_DEVICES"] = gpu.uuid
    env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(limits.core)
    env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={memory_limit_mib(gpu, limits)}M"
    if mps_pipe_directory is not None:
        env["CUDA_MPS_PIPE_DIRECTORY"] = mps_pipe_directory
    env["GPUPOOL_POD"] = pod.key
    env["GPUPOOL_GPU_INDEX"] = str(gpu.index)
    env["GPUPOOL_GPU_UUID"] = gpu.uuid
    return env
