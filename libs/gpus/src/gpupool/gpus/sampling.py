"""Sampling the GPUs while workloads run: a one-method port, an NVML adapter and a simulated one."""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from gpupool.events import InventorySource
from gpupool.gpus.inventory import Inventory, NvmlUnavailable
from gpupool.gpus.nvml import MIB, load_pynvml


class GpuSample(msgspec.Struct, frozen=True, kw_only=True):
    """One GPU at one moment: whole-card figures and the memory each process holds on it."""

    index: int
    uuid: str
    memory_used_bytes: int
    memory_total_bytes: int
    utilisation: float
    """Fraction of the sample period the card was busy, 0.0..1.0."""
    process_memory_bytes: dict[int, int] = msgspec.field(default_factory=dict)
    """Host pid -> GPU memory that process holds on this card (pids NVML cannot size are left out)."""


class SamplingFailed(RuntimeError):
    """A sample could not be taken (the card fell off the bus, the driver went away, ...)."""


class GpuSampler(Protocol):
    """Reads the GPUs of the node. ``source`` says whether the numbers are real."""

    @property
    def source(self) -> InventorySource: ...

    def sample(self) -> tuple[GpuSample, ...]:
        """Every GPU of the inventory, in inventory order; raises SamplingFailed."""
        ...


class NvmlSampler:
    """Samples through NVML; ``nvml`` is a module shaped like ``pynvml`` (default: the real one).

    Initialises NVML on construction (raising :class:`NvmlUnavailable`) and shuts it down on
    :meth:`close`. Blocking: call :meth:`sample` from a worker thread in async code.
    """

    def __init__(self, inventory: Inventory, nvml: Any = None) -> None:
        self._nvml = load_pynvml() if nvml is None else nvml
        self._inventory = inventory
        try:
            self._nvml.nvmlInit()
        except self._nvml.NVMLError as error:
            raise NvmlUnavailable(str(error)) from error
        try:
            self._handles = [
                (gpu, self._nvml.nvmlDeviceGetHandleByUUID(gpu.uuid)) for gpu in inventory.gpus
            ]
        except self._nvml.NVMLError as error:
            self._nvml.nvmlShutdown()
            raise NvmlUnavailable(str(error)) from error
        self._closed = False

    @property
    def source(self) -> InventorySource:
        return "nvml"

    def sample(self) -> tuple[GpuSample, ...]:
        """Raises :class:`SamplingFailed` with NVML's reason when a card cannot be read."""
        if self._closed:
            raise RuntimeError("the NVML sampler is closed")
        try:
            return self._sample()
        except self._nvml.NVMLError as error:
            raise SamplingFailed(str(error)) from error

    def _sample(self) -> tuple[GpuSample, ...]:
        nvml = self._nvml
        samples = []
        for gpu, handle in self._handles:
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            rates = nvml.nvmlDeviceGetUtilizationRates(handle)
            processes = {
                int(process.pid): int(process.usedGpuMemory)
                for process in nvml.nvmlDeviceGetComputeRunningProcesses(handle)
                if process.usedGpuMemory is not None
            }
            samples.append(
                GpuSample(
                    index=gpu.index,
                    uuid=gpu.uuid,
                    memory_used_bytes=int(memory.used),
                    memory_total_bytes=int(memory.total),
                    utilisation=min(max(int(rates.gpu), 0), 100) / 100,
                    process_memory_bytes=processes,
                )
            )
        return tuple(samples)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._nvml.nvmlShutdown()


class SimulatedSampler:
    """For a simulated inventory: idle cards, and no per-process figures (nothing can be measured)."""

    def __init__(self, inventory: Inventory) -> None:
        if not inventory.simulated:
            raise ValueError("SimulatedSampler is for simulated inventories only")
        self._inventory = inventory

    @property
    def source(self) -> InventorySource:
        return "simulated"

    def sample(self) -> tuple[GpuSample, ...]:
        return tuple(
            GpuSample(
                index=gpu.index,
                uuid=gpu.uuid,
                memory_used_bytes=0,
                memory_total_bytes=gpu.memory_mib * MIB,
                utilisation=0.0,
            )
            for gpu in self._inventory.gpus
        )

    def close(self) -> None:
        """Nothing to release; present so both samplers close alike."""
