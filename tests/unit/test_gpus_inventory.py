"""GPU discovery and sampling: the real NVML failure here, and NVML's API via a stand-in module."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from gpupool.events import GpuInfo
from gpupool.gpus import (
    GpuSample,
    Inventory,
    NvmlSampler,
    NvmlUnavailable,
    SamplingFailed,
    SimulatedSampler,
    discover_nvml,
    simulated_inventory,
)

MIB = 1024 * 1024


class FakeNvmlError(Exception):
    def __init__(self, value: int) -> None:
        self.value = value

    def __str__(self) -> str:
        return {9: "Driver Not Loaded", 15: "GPU is lost"}.get(self.value, f"error {self.value}")


class FakeNvml:
    """The part of ``pynvml``'s surface gpupool uses, over a table of cards."""

    NVMLError = FakeNvmlError

    def __init__(self, cards: list[dict[str, Any]], *, init_error: int | None = None) -> None:
        self.cards = cards
        self.init_error = init_error
        self.initialised = 0
        self.lost: set[str] = set()

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise FakeNvmlError(self.init_error)
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self.initialised -= 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.cards)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> dict[str, Any]:
        return self.cards[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> dict[str, Any]:
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        return next(card for card in self.cards if card["uuid"] == uuid)

    def nvmlDeviceGetUUID(self, handle: dict[str, Any]) -> bytes:
        return str(handle["uuid"]).encode()  # older pynvml returns bytes

    def nvmlDeviceGetName(self, handle: dict[str, Any]) -> str:
        return str(handle["name"])

    def _check(self, handle: dict[str, Any]) -> None:
        if handle["uuid"] in self.lost:
            raise FakeNvmlError(15)

    def nvmlDeviceGetMemoryInfo(self, handle: dict[str, Any]) -> SimpleNamespace:
        self._check(handle)
        return SimpleNamespace(total=handle["total"], used=handle["used"], free=0)

    def nvmlDeviceGetUtilizationRates(self, handle: dict[str, Any]) -> SimpleNamespace:
        self._check(handle)
        return SimpleNamespace(gpu=handle["util"], memory=0)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: dict[str, Any]) -> list[SimpleNamespace]:
        self._check(handle)
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in handle["procs"]]


def two_h200s() -> FakeNvml:
    return FakeNvml(
        [
            {"uuid": "GPU-aaaa", "name": "NVIDIA H200", "total": 143771 * MIB, "used": 5 * MIB,
             "util": 0, "procs": []},
            {"uuid": "GPU-bbbb", "name": "NVIDIA H200", "total": 143771 * MIB + 123, "used": 70 * MIB,
             "util": 87, "procs": [(4242, 60 * MIB), (4243, None)]},
        ]
    )  # fmt: skip


def test_discover_nvml_without_a_driver_raises_with_nvmls_reason() -> None:
    """The real pynvml on this machine: no driver, no library."""
    with pytest.raises(NvmlUnavailable) as unavailable:
        discover_nvml()
    assert unavailable.value.reason == "NVML Shared Library Not Found"
    assert "NVML Shared Library Not Found" in str(unavailable.value)


def test_discover_nvml_reads_every_card_in_index_order() -> None:
    nvml = two_h200s()
    inventory = discover_nvml(nvml)
    assert inventory == Inventory(
        gpus=(
            GpuInfo(index=0, uuid="GPU-aaaa", memory_mib=143771, name="NVIDIA H200"),
            GpuInfo(index=1, uuid="GPU-bbbb", memory_mib=143771, name="NVIDIA H200"),
        ),
        source="nvml",
    )
    assert not inventory.simulated
    assert nvml.initialised == 0  # shut down again


def test_discover_nvml_driver_error_is_nvml_unavailable() -> None:
    with pytest.raises(NvmlUnavailable, match="Driver Not Loaded"):
        discover_nvml(FakeNvml([], init_error=9))


def test_simulated_inventory_is_obviously_simulated() -> None:
    inventory = simulated_inventory(3, node="cn-wulanchabu-c.cr-xxx")
    assert inventory.source == "simulated"
    assert inventory.simulated
    assert [gpu.uuid for gpu in inventory.gpus] == [
        "GPU-SIMULATED-cn-wulanchabu-c.cr-xxx-0",
        "GPU-SIMULATED-cn-wulanchabu-c.cr-xxx-1",
        "GPU-SIMULATED-cn-wulanchabu-c.cr-xxx-2",
    ]
    assert [gpu.index for gpu in inventory.gpus] == [0, 1, 2]
    assert {gpu.memory_mib for gpu in inventory.gpus} == {81559}
    assert inventory.describe().startswith("SIMULATED GPUs: 3 [0=GPU-SIMULATED-")
    assert simulated_inventory(1, 1024).gpus[0].memory_mib == 1024


@pytest.mark.parametrize(("count", "memory"), [(0, 100), (-1, 100), (2, 0)])
def test_simulated_inventory_refuses_nonsense(count: int, memory: int) -> None:
    with pytest.raises(ValueError, match="simulated"):
        simulated_inventory(count, memory)


def test_nvml_sampler_reports_cards_and_per_process_memory() -> None:
    nvml = two_h200s()
    inventory = discover_nvml(nvml)
    sampler = NvmlSampler(inventory, nvml)
    assert sampler.source == "nvml"
    assert sampler.sample() == (
        GpuSample(index=0, uuid="GPU-aaaa", memory_used_bytes=5 * MIB,
                  memory_total_bytes=143771 * MIB, utilisation=0.0, process_memory_bytes={}),
        GpuSample(index=1, uuid="GPU-bbbb", memory_used_bytes=70 * MIB,
                  memory_total_bytes=143771 * MIB + 123, utilisation=0.87,
                  process_memory_bytes={4242: 60 * MIB}),  # 4243: NVML could not size it
    )  # fmt: skip
    sampler.close()
    sampler.close()
    assert nvml.initialised == 0
    with pytest.raises(RuntimeError, match="closed"):
        sampler.sample()


def test_nvml_sampler_turns_a_lost_card_into_sampling_failed() -> None:
    nvml = two_h200s()
    sampler = NvmlSampler(discover_nvml(nvml), nvml)
    nvml.lost.add("GPU-bbbb")
    with pytest.raises(SamplingFailed, match="GPU is lost"):
        sampler.sample()


def test_nvml_sampler_without_a_driver() -> None:
    with pytest.raises(NvmlUnavailable, match="NVML Shared Library Not Found"):
        NvmlSampler(simulated_inventory(1))


def test_simulated_sampler_says_so_and_measures_nothing_per_process() -> None:
    inventory = simulated_inventory(2, 1000, node="n1")
    sampler = SimulatedSampler(inventory)
    assert sampler.source == "simulated"
    samples = sampler.sample()
    assert [(s.uuid, s.memory_total_bytes, s.process_memory_bytes) for s in samples] == [
        ("GPU-SIMULATED-n1-0", 1000 * MIB, {}),
        ("GPU-SIMULATED-n1-1", 1000 * MIB, {}),
    ]
    with pytest.raises(ValueError, match="simulated"):
        SimulatedSampler(discover_nvml(two_h200s()))
