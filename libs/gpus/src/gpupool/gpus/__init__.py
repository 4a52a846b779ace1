"""The node's GPUs: discovery through NVML (or an explicitly simulated inventory) and sampling.

Only this package and the node-executor import ``pynvml``. The NVML code takes the
module as a parameter (defaulting to the real ``pynvml``) so that it can be exercised
against a stand-in where no driver exists.
"""

from gpupool.gpus.inventory import (
    DEFAULT_SIMULATED_MEMORY_MIB,
    SIMULATED_UUID_PREFIX,
    Inventory,
    NvmlUnavailable,
    discover_nvml,
    simulated_inventory,
)
from gpupool.gpus.sampling import (
    GpuSample,
    GpuSampler,
    NvmlSampler,
    SamplingFailed,
    SimulatedSampler,
)

__all__ = [
    "DEFAULT_SIMULATED_MEMORY_MIB",
    "SIMULATED_UUID_PREFIX",
    "GpuSample",
    "GpuSampler",
    "Inventory",
    "NvmlSampler",
    "NvmlUnavailable",
    "SamplingFailed",
    "SimulatedSampler",
    "discover_nvml",
    "simulated_inventory",
]
