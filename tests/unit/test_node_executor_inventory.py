"""The executor's inventory rule: NVML or nothing, unless a simulated inventory is asked for."""

from __future__ import annotations

import logging

import msgspec
import pytest

from gpupool.events import GpuInfo, PodRef
from gpupool.gpus import GpuSample, Inventory, NvmlUnavailable, SimulatedSampler
from gpupool.node_executor.inventory import (
    ExecutorReadings,
    NoGpuInventory,
    sampler_for,
    select_inventory,
)
from gpupool.observability.service_metrics import executor_registry, metrics_projection


class FixedSampler:
    """A card that reports itself idle (no NVML here)."""

    def __init__(self, inventory: Inventory) -> None:
        self.inventory = inventory
        self.source = inventory.source

    def sample(self) -> tuple[GpuSample, ...]:
        return tuple(
            GpuSample(
                index=g.index,
                uuid=g.uuid,
                memory_used_bytes=0,
                memory_total_bytes=g.memory_mib << 20,
                utilisation=0.0,
            )
            for g in self.inventory.gpus
        )


REAL = Inventory(gpus=(GpuInfo(index=0, uuid="GPU-real-0", memory_mib=81559),), source="nvml")


def test_refuses_to_start_without_nvml_here() -> None:
    """The real discovery on this machine, which has no NVML."""
    with pytest.raises(NoGpuInventory) as refused:
        select_inventory(node="n1", simulate_gpus=None)
    assert "NVML Shared Library Not Found" in str(refused.value)
    assert "--simulate-gpus N" in str(refused.value)


def test_refuses_an_empty_nvml_inventory() -> None:
    with pytest.raises(NoGpuInventory, match="no GPUs"):
        select_inventory(
            node="n1", simulate_gpus=None, discover=lambda: Inventory(gpus=(), source="nvml")
        )


def test_uses_nvml_when_it_works() -> None:
    assert select_inventory(node="n1", simulate_gpus=None, discover=lambda: REAL) is REAL


def test_simulated_only_when_asked_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    def no_nvml() -> Inventory:
        raise NvmlUnavailable("NVML Shared Library Not Found")

    with caplog.at_level(logging.WARNING, logger="gpupool.node_executor.inventory"):
        inventory = select_inventory(node="n1", simulate_gpus=2, discover=no_nvml)
    assert inventory.source == "simulated"
    assert [gpu.uuid for gpu in inventory.gpus] == ["GPU-SIMULATED-n1-0", "GPU-SIMULATED-n1-1"]
    assert caplog.messages[0].startswith("SIMULATED GPUs: 2 [")
    assert isinstance(sampler_for(inventory), SimulatedSampler)


@pytest.mark.parametrize(
    ("inventory", "simulated", "source", "count"),
    [
        pytest.param(REAL, 0.0, "nvml", 1.0, id="nvml"),
        pytest.param(
            select_inventory(node="n1", simulate_gpus=4), 1.0, "simulated", 4.0, id="simulated"
        ),
    ],
)
def test_metrics_say_whether_gpus_are_simulated(
    inventory: Inventory, simulated: float, source: str, count: float
) -> None:
    readings = ExecutorReadings("n1", inventory, FixedSampler(inventory), dict)
    registry = executor_registry(metrics_projection(), readings)
    assert registry.get_sample_value("gpupool_inventory_simulated", {"node": "n1"}) == simulated
    assert readings.source == source
    assert len(list(readings.gpu_samples())) == count


class CountingSampler(FixedSampler):
    """Two processes on the card; counts the samples taken."""

    def __init__(self, inventory: Inventory) -> None:
        super().__init__(inventory)
        self.taken = 0

    def sample(self) -> tuple[GpuSample, ...]:
        self.taken += 1
        return tuple(
            msgspec.structs.replace(s, process_memory_bytes={4711: 1, 4712: 2})
            for s in super().sample()
        )


def test_a_scrape_asks_for_the_pod_processes_among_its_own_samples_pids_only() -> None:
    """No list of every process: the pods' processes are asked of the pids the scrape's
    sample names, and that same sample gives the scrape's GPU figures (one sample)."""
    sampler = CountingSampler(REAL)
    asked: list[set[int]] = []

    def among(pids: object) -> dict[PodRef, list[int]]:
        asked.append(set(pids))  # type: ignore[call-overload]
        return {}

    def every_process() -> dict[PodRef, list[int]]:
        raise AssertionError("the scan of every process was asked for")

    readings = ExecutorReadings("n1", REAL, sampler, every_process, pod_processes_among=among)
    registry = executor_registry(metrics_projection(), readings)
    assert registry.get_sample_value("gpupool_inventory_simulated", {"node": "n1"}) == 0.0
    assert asked and all(pids == {4711, 4712} for pids in asked)
    assert sampler.taken == len(asked)  # one sample per scrape, for both


class TimeSharingSample(GpuSample, frozen=True, kw_only=True):
    """A reading that also knows each process's share of the card's time."""

    process_utilisation: dict[int, float] = msgspec.field(default_factory=dict)


class TimeSharingSampler(FixedSampler):
    """Pid 4713 has a share of the card's time but no memory NVML could size."""

    def sample(self) -> tuple[GpuSample, ...]:
        return tuple(
            TimeSharingSample(
                **msgspec.structs.asdict(s) | {"process_memory_bytes": {4711: 1}},
                process_utilisation={4711: 0.25, 4713: 0.5},
            )
            for s in super().sample()
        )


def test_a_scrape_asks_about_every_pid_the_collector_counts_time_sharers_too() -> None:
    asked: list[set[int]] = []

    def among(pids: object) -> dict[PodRef, list[int]]:
        asked.append(set(pids))  # type: ignore[call-overload]
        return {}

    def every_process() -> dict[PodRef, list[int]]:
        raise AssertionError("the scan of every process was asked for")

    readings = ExecutorReadings(
        "n1", REAL, TimeSharingSampler(REAL), every_process, pod_processes_among=among
    )
    registry = executor_registry(metrics_projection(), readings)
    assert registry.get_sample_value("gpupool_inventory_simulated", {"node": "n1"}) == 0.0
    assert asked and all(pids == {4711, 4713} for pids in asked)
