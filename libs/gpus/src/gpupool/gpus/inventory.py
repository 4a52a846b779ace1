"""What GPUs a node has: read from NVML, or simulated on request (and then obviously so)."""

from __future__ import annotations

from typing import Any

import msgspec

from gpupool.events import GpuInfo, InventorySource
from gpupool.gpus.nvml import MIB, load_pynvml, nvml_text

DEFAULT_SIMULATED_MEMORY_MIB = 81559
"""The memory NVML reports for an 80 GB H100/A100 card; the default size of a simulated GPU."""

SIMULATED_UUID_PREFIX = "GPU-SIMULATED-"
"""Every simulated GPU's UUID starts with this, so that no one mistakes it for hardware."""


class NvmlUnavailable(RuntimeError):
    """NVML could not be used; ``reason`` is NVML's own words (e.g. "NVML Shared Library Not Found")."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"NVML is unavailable: {reason}")
        self.reason = reason


class Inventory(msgspec.Struct, frozen=True, kw_only=True):
    """The GPUs of one node and where that knowledge came from."""

    gpus: tuple[GpuInfo, ...]
    source: InventorySource

    @property
    def simulated(self) -> bool:
        return self.source == "simulated"

    def by_index(self, index: int) -> GpuInfo:
        for gpu in self.gpus:
            if gpu.index == index:
                return gpu
        raise KeyError(f"no GPU with index {index} in the inventory")

    def describe(self) -> str:
        """One line for logs, e.g. ``SIMULATED GPUs: 2 x 81559 MiB (GPU-SIMULATED-n1-0, ...)``."""
        label = "SIMULATED GPUs" if self.simulated else "NVML GPUs"
        listed = ", ".join(f"{gpu.index}={gpu.uuid} ({gpu.memory_mib} MiB)" for gpu in self.gpus)
        return f"{label}: {len(self.gpus)} [{listed}]"


def discover_nvml(nvml: Any = None) -> Inventory:
    """The node's GPUs as NVML reports them, in NVML index order.

    ``nvml`` is a module shaped like ``pynvml`` (default: the real one). Raises
    :class:`NvmlUnavailable`, carrying NVML's reason, when there is no usable driver.
    """
    nvml = load_pynvml() if nvml is None else nvml
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as error:
        raise NvmlUnavailable(str(error)) from error
    try:
        gpus = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(
                GpuInfo(
                    index=index,
                    uuid=nvml_text(nvml.nvmlDeviceGetUUID(handle)),
                    memory_mib=int(memory.total) // MIB,
                    name=nvml_text(nvml.nvmlDeviceGetName(handle)),
                )
            )
    except nvml.NVMLError as error:
        raise NvmlUnavailable(str(error)) from error
    finally:
        nvml.nvmlShutdown()
    return Inventory(gpus=tuple(gpus), source="nvml")


def simulated_inventory(
    count: int, memory_mib: int = DEFAULT_SIMULATED_MEMORY_MIB, *, node: str = "local"
) -> Inventory:
    """``count`` fake GPUs with UUIDs ``GPU-SIMULATED-<node>-<index>``: for demos and tests only."""
    if count < 1:
        raise ValueError(f"a simulated inventory needs at least one GPU, not {count}")
    if memory_mib < 1:
        raise ValueError(f"a simulated GPU needs a positive memory size, not {memory_mib} MiB")
    return Inventory(
        gpus=tuple(
            GpuInfo(
                index=index,
                uuid=f"{SIMULATED_UUID_PREFIX}{node}-{index}",
                memory_mib=memory_mib,
                name="Simulated GPU (no hardware)",
            )
            for index in range(count)
        ),
        source="simulated",
    )
