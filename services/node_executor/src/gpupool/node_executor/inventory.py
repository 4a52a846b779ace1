"""Which GPUs the node-executor publishes: NVML's, or, only when asked, simulated ones.

Without NVML the executor refuses to start, unless ``--simulate-gpus N`` was given; then it
logs ``SIMULATED GPUs: ...``, reports the inventory with ``source="simulated"``, and exports
``gpupool_inventory_simulated 1`` (gpupool.observability.executor_metrics, read through
:class:`ExecutorReadings`) so that no dashboard mistakes the node for real hardware.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from gpupool.events import InventorySource, PodRef
from gpupool.gpus import (
    DEFAULT_SIMULATED_MEMORY_MIB,
    GpuSample,
    GpuSampler,
    Inventory,
    NvmlSampler,
    NvmlUnavailable,
    SamplingFailed,
    SimulatedSampler,
    discover_nvml,
    simulated_inventory,
)
from gpupool.observability.executor_metrics import card_pids

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


class ExecutorReadings:
    """What the node-executor's metrics read (the observability port ``ExecutorReadings``):
    fresh GPU samples on each scrape, and which processes belong to which pod."""

    def __init__(
        self,
        node: str,
        inventory: Inventory,
        sampler: GpuSampler,
        pod_processes: Callable[[], Mapping[PodRef, Collection[int]]],
        *,
        pod_processes_among: Callable[[Collection[int]], Mapping[PodRef, Collection[int]]]
        | None = None,
    ) -> None:
        self.node = node
        self.source: InventorySource = inventory.source
        self._sampler = sampler
        self._pod_processes = pod_processes
        self._pod_processes_among = pod_processes_among
        self._scrape_sample: Sequence[GpuSample] | None = None
        """Taken by ``pod_processes`` for the ``gpu_samples`` of the same scrape."""

    def _sample(self) -> Sequence[GpuSample]:
        try:
            return self._sampler.sample()
        except SamplingFailed as error:
            log.warning("GPU sampling failed during a scrape: %s", error)
            return ()

    def gpu_samples(self) -> Sequence[GpuSample]:
        if self._scrape_sample is not None:  # the scrape's own, taken for its pod processes
            samples, self._scrape_sample = self._scrape_sample, None
            return samples
        return self._sample()

    def pod_processes(self) -> Mapping[PodRef, Collection[int]]:
        """Each pod's processes; with ``pod_processes_among``, asked of the pids the scrape's
        sample names only (no scan of ``/proc``), and that sample is the scrape's figures."""
        if self._pod_processes_among is None:
            return self._pod_processes()
        samples = self._scrape_sample = self._sample()
        # every pid the collector counts: GPU memory holders and, where read, time sharers
        return self._pod_processes_among({pid for s in samples for pid in card_pids(s)})
