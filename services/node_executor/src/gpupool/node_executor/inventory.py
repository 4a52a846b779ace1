"""Which GPUs the node-executor publishes: NVML's, or, only when asked, simulated ones.

Without NVML the executor refuses to start, unless ``--simulate-gpus N`` was given; then it
logs ``SIMULATED GPUs: ...``, reports the inventory with ``source="simulated"``, and exports
``gpupool_inventory_simulated 1`` so that no dashboard mistakes the node for real hardware.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from gpupool.gpus import (
    DEFAULT_SIMULATED_MEMORY_MIB,
    GpuSampler,
    Inventory,
    NvmlSampler,
    NvmlUnavailable,
    SimulatedSampler,
    discover_nvml,
    simulated_inventory,
)

log = logging.getLogger(__name__)


class NoGpuInventory(RuntimeError):
    """The executor has no GPUs to offer and was not asked to simulate any: it must not start."""


def select_inventory(
    *,
    node: str,
    simulate_gpus: int | None,
    simulated_memory_mib: int = DEFAULT_SIMULATED_MEMORY_MIB,
    discover: Callable[[], Inventory] = discover_nvml,
) -> Inventory:
    """NVML's inventory; a simulated one only when ``simulate_gpus`` is given (and then logged)."""
    if simulate_gpus is not None:
        inventory = simulated_inventory(simulate_gpus, simulated_memory_mib, node=node)
        log.warning("%s (--simulate-gpus: no real GPU is used)", inventory.describe())
        return inventory
    try:
        inventory = discover()
    except NvmlUnavailable as error:
        raise NoGpuInventory(
            f"NVML is unavailable ({error.reason}): refusing to start without GPUs. "
            "To run without GPUs (demos, tests), pass --simulate-gpus N; the node's "
            "inventory is then published as simulated."
        ) from error
    if not inventory.gpus:
        raise NoGpuInventory("NVML reports no GPUs on this node: refusing to start.")
    log.info("%s", inventory.describe())
    return inventory


def sampler_for(inventory: Inventory, nvml: Any = None) -> GpuSampler:
    """The sampler that matches the inventory's source."""
    if inventory.simulated:
        return SimulatedSampler(inventory)
    return NvmlSampler(inventory, nvml)


class InventoryCollector:
    """``gpupool_inventory_simulated`` (1 when the GPUs are simulated) and ``gpupool_node_gpus``."""

    def __init__(self, node: str, inventory: Inventory) -> None:
        self._node = node
        self._inventory = inventory

    def collect(self) -> Iterator[Metric]:
        simulated = GaugeMetricFamily(
            "gpupool_inventory_simulated",
            "1 when this node-executor publishes a simulated GPU inventory (no real GPUs)",
            labels=["node"],
        )
        simulated.add_metric([self._node], 1.0 if self._inventory.simulated else 0.0)
        yield simulated
        gpus = GaugeMetricFamily(
            "gpupool_node_gpus",
            "GPUs this node-executor publishes, by source (nvml or simulated)",
            labels=["node", "source"],
        )
        gpus.add_metric([self._node, self._inventory.source], float(len(self._inventory.gpus)))
        yield gpus
