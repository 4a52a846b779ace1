"""The node-executor's GPU and pod metrics, read through the ExecutorReadings port."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from datetime import UTC, datetime

import msgspec
import pytest
from observability_logs import exposition, promtool_check

from gpupool.events import (
    Assigned,
    Envelope,
    Event,
    GpuInfo,
    GpuInventoryReported,
    InventorySource,
    NodeConfigured,
    PodReady,
    PodRef,
    PodRegistered,
    Share,
)
from gpupool.gpus import GpuSample
from gpupool.observability import GpuReading, Projection, metrics_registry
from gpupool.observability.executor_metrics import utilisation_of_limit

NODE = "gpu-node-1"
GIB = 1 << 30
A, B, C = (PodRef(namespace="ml", name=name) for name in ("pod-a", "pod-b", "pod-c"))
LIMITS = {A: 50, B: 50, C: 100}
PLACEMENT = {A: 0, B: 0, C: 1}


class SampleWithProcessUtilisation(GpuSample, frozen=True, kw_only=True):
    """A reading that also knows each process's share of the card (the optional protocol)."""

    process_utilisation: dict[int, float] = msgspec.field(default_factory=dict)


class Readings:
    def __init__(
        self,
        samples: Sequence[GpuReading],
        processes: Mapping[PodRef, Collection[int]],
        source: InventorySource = "nvml",
    ) -> None:
        self.node = NODE
        self.source: InventorySource = source
        self._samples = samples
        self._processes = processes

    def gpu_samples(self) -> Sequence[GpuReading]:
        return self._samples

    def pod_processes(self) -> Mapping[PodRef, Collection[int]]:
        return self._processes


def projection_with_running_pods() -> Projection:
    """A and B run on GPU 0 (limits 50), C on GPU 1 (limit 100)."""
    gpus = tuple(GpuInfo(index=i, uuid=f"GPU-{i}", memory_mib=80 * 1024) for i in (0, 1))
    events: list[Event] = [
        GpuInventoryReported(node=NODE, gpus=gpus, source="nvml"),
        NodeConfigured(node=NODE, policy="share-pool", gpu_count=2),
    ]
    for ref, limit in LIMITS.items():
        events += [
            PodRegistered(
                pod=ref,
                node=NODE,
                policy="share-pool",
                requests=Share(core=10, memory=10),
                limits=Share(core=limit, memory=limit),
            ),
            PodReady(pod=ref, node=NODE),
            Assigned(
                pod=ref, node=NODE, gpu_index=PLACEMENT[ref], gpu_uuid=f"GPU-{PLACEMENT[ref]}"
            ),
        ]
    projection = Projection()
    time = datetime(2025, 1, 1, tzinfo=UTC)
    for seq, event in enumerate(events, start=1):
        projection.apply(seq, Envelope(id=str(seq), time=time, event=event))
    return projection


PROCESSES = {A: [101, 102], B: [201], C: [301], PodRef(namespace="ml", name="idle"): [401]}


def card(index: int, utilisation: float, processes: dict[int, int]) -> GpuSample:
    return GpuSample(
        index=index,
        uuid=f"GPU-{index}",
        memory_used_bytes=sum(processes.values()) + GIB // 2,
        memory_total_bytes=80 * GIB,
        utilisation=utilisation,
        process_memory_bytes=processes,
    )


def pod_labels(ref: PodRef, gpu: int) -> dict[str, str]:
    return {"node": NODE, "pod": ref.name, "namespace": ref.namespace, "gpu": str(gpu)}


def test_gpu_figures_stay_absolute_and_pod_memory_sums_the_pods_processes() -> None:
    samples = [
        card(0, 0.8, {101: 2 * GIB, 102: GIB, 201: 4 * GIB}),
        card(1, 0.3, {301: 10 * GIB}),
    ]
    registry = metrics_registry(
        projection_with_running_pods(), queue=False, executor=Readings(samples, PROCESSES)
    )

    gpu0 = {"node": NODE, "gpu": "0", "uuid": "GPU-0"}
    assert registry.get_sample_value("gpupool_gpu_memory_used_bytes", gpu0) == 7.5 * GIB
    assert registry.get_sample_value("gpupool_gpu_memory_total_bytes", gpu0) == 80 * GIB
    assert registry.get_sample_value("gpupool_gpu_utilization_ratio", gpu0) == 0.8
    assert registry.get_sample_value("gpupool_inventory_simulated", {"node": NODE}) == 0
    memory = "gpupool_pod_gpu_memory_used_bytes"
    assert registry.get_sample_value(memory, pod_labels(A, 0)) == 3 * GIB
    assert registry.get_sample_value(memory, pod_labels(B, 0)) == 4 * GIB
    assert registry.get_sample_value(memory, pod_labels(C, 1)) == 10 * GIB
    assert registry.get_sample_value(memory, pod_labels(A, 1)) is None


def test_a_pod_alone_on_its_card_gets_the_cards_utilisation_relative_to_its_limit() -> None:
    samples = [card(0, 0.8, {101: GIB, 201: GIB}), card(1, 0.3, {301: GIB})]
    registry = metrics_registry(
        projection_with_running_pods(), queue=False, executor=Readings(samples, PROCESSES)
    )

    ratio = "gpupool_pod_compute_utilization_of_limit_ratio"
    assert registry.get_sample_value(ratio, pod_labels(C, 1)) == pytest.approx(0.3)
    # A and B share GPU 0 and there are no per-process figures: not exported rather than guessed.
    assert registry.get_sample_value(ratio, pod_labels(A, 0)) is None
    assert registry.get_sample_value(ratio, pod_labels(B, 0)) is None


def test_per_process_utilisation_is_summed_per_pod_and_capped_at_the_limit() -> None:
    samples = [
        SampleWithProcessUtilisation(
            index=0,
            uuid="GPU-0",
            memory_used_bytes=3 * GIB,
            memory_total_bytes=80 * GIB,
            utilisation=0.95,
            process_memory_bytes={101: GIB, 201: GIB},
            process_utilisation={101: 0.15, 102: 0.10, 201: 0.70},
        )
    ]
    registry = metrics_registry(
        projection_with_running_pods(), queue=False, executor=Readings(samples, PROCESSES)
    )

    ratio = "gpupool_pod_compute_utilization_of_limit_ratio"
    # A: 0.25 of the card with a 50 % limit is half its limit; B used more than its limit.
    assert registry.get_sample_value(ratio, pod_labels(A, 0)) == pytest.approx(0.5)
    assert registry.get_sample_value(ratio, pod_labels(B, 0)) == 1.0


@pytest.mark.parametrize(
    ("utilisation", "limit", "expected"),
    [
        pytest.param(0.5, 100, 0.5, id="whole-card-limit"),
        pytest.param(0.1, 10, 1.0, id="exactly-at-limit"),
        pytest.param(0.05, 10, 0.5, id="half-of-a-small-limit"),
        pytest.param(0.9, 50, 1.0, id="over-limit-capped"),
        pytest.param(-0.1, 50, 0.0, id="negative-reading-floored"),
    ],
)
def test_utilisation_of_limit(utilisation: float, limit: int, expected: float) -> None:
    assert utilisation_of_limit(utilisation, limit) == pytest.approx(expected)


def test_a_simulated_inventory_says_so() -> None:
    registry = metrics_registry(
        projection_with_running_pods(),
        queue=False,
        executor=Readings([card(0, 0.0, {})], {}, source="simulated"),
    )

    assert registry.get_sample_value("gpupool_inventory_simulated", {"node": NODE}) == 1


@pytest.mark.prometheus
def test_promtool_accepts_the_executor_metrics() -> None:
    samples = [card(0, 0.8, {101: GIB, 201: GIB}), card(1, 0.3, {301: GIB})]
    registry = metrics_registry(
        projection_with_running_pods(), queue=False, executor=Readings(samples, PROCESSES)
    )
    text = exposition(registry)

    assert "gpupool_pod_compute_utilization_of_limit_ratio{" in text
    assert promtool_check(text) == (0, set())
