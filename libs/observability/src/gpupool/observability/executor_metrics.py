"""The node-executor's metrics: whole-card GPU figures and each pod's share, computed on scrape.

The collector reads a small port, :class:`ExecutorReadings`: the latest GPU samples
and which host pids belong to which pod. ``gpupool.gpus.GpuSample`` satisfies
:class:`GpuReading` as it is, so the node-executor hands its sampler's latest
samples through without conversion (this package does not import the sampler or
NVML).

docs/behaviour.md: GPU utilisation and memory stay absolute (whole card); inside the
pod compute utilisation is relative to the pod's limit::

    gpupool_pod_compute_utilization_of_limit_ratio = min(1, utilisation / (core limit / 100))

where ``utilisation`` is the fraction of the card's time the pod's processes kept
it busy. With per-process figures (a reading that also has ``process_utilisation``)
it is their sum; without them it is the card's utilisation when the pod is the only
pod with processes on the card, and it is not exported when several pods share the
card (a split would be a guess). It is capped at 1: a pod at or above its limit
reads 1, and the whole-card utilisation shows any excess.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import Protocol, runtime_checkable

from prometheus_client.core import GaugeMetricFamily, Metric

from gpupool.events import InventorySource, PodRef
from gpupool.runtime.projection import Projection


class GpuReading(Protocol):
    """One GPU at one moment (``gpupool.gpus.GpuSample`` has this shape)."""

    @property
    def index(self) -> int: ...
    @property
    def uuid(self) -> str: ...
    @property
    def memory_used_bytes(self) -> int: ...
    @property
    def memory_total_bytes(self) -> int: ...
    @property
    def utilisation(self) -> float:
        """Fraction of the sample period the card was busy, 0.0..1.0."""
        ...

    @property
    def process_memory_bytes(self) -> Mapping[int, int]:
        """Host pid -> GPU memory that process holds on this card."""
        ...


@runtime_checkable
class ProcessUtilisation(Protocol):
    """Optionally, a reading also knows each process's share of the card's time."""

    @property
    def process_utilisation(self) -> Mapping[int, float]:
        """Host pid -> fraction of the sample period that process kept the card busy."""
        ...


class ExecutorReadings(Protocol):
    """What the node-executor knows about its node's GPUs and pods, at the moment of a scrape."""

    @property
    def node(self) -> str: ...
    @property
    def source(self) -> InventorySource:
        """``simulated`` when the GPUs are not real (then every figure is made up)."""
        ...

    def gpu_samples(self) -> Sequence[GpuReading]:
        """The latest sample of every GPU (empty before the first one)."""
        ...

    def pod_processes(self) -> Mapping[PodRef, Collection[int]]:
        """Host pids of the processes each running pod has started."""
        ...


GPU_LABELS = ("node", "gpu", "uuid")
POD_LABELS = ("node", "pod", "namespace", "gpu")


def card_pids(reading: GpuReading) -> set[int]:
    """The pids a reading names: those with GPU memory on the card, and those with a share of
    its time (a reading with ``process_utilisation``)."""
    pids = set(reading.process_memory_bytes)
    if isinstance(reading, ProcessUtilisation):
        pids.update(reading.process_utilisation)
    return pids


def pod_utilisation(
    reading: GpuReading, pod_pids: Collection[int], pods_on_card: int
) -> float | None:
    """Fraction of the card's time the pod used (None if it cannot be told apart from others)."""
    if isinstance(reading, ProcessUtilisation):
        shares = reading.process_utilisation
        return sum(shares.get(pid, 0.0) for pid in pod_pids)
    if pods_on_card == 1:
        return reading.utilisation
    return None


def utilisation_of_limit(utilisation: float, core_limit_percent: int) -> float:
    """docs/behaviour.md: compute utilisation relative to the pod's limit, capped at 1."""
    return min(1.0, max(0.0, utilisation) / (core_limit_percent / 100))


class _ExecutorFamilies:
    def __init__(self) -> None:
        self.simulated = GaugeMetricFamily(
            "gpupool_inventory_simulated",
            "1 if the node's GPUs are simulated (no NVML): its GPU figures are not real.",
            labels=["node"],
        )
        self.memory_used = GaugeMetricFamily(
            "gpupool_gpu_memory_used_bytes",
            "GPU memory in use on the whole card.",
            labels=GPU_LABELS,
        )
        self.memory_total = GaugeMetricFamily(
            "gpupool_gpu_memory_total_bytes", "GPU memory of the whole card.", labels=GPU_LABELS
        )
        self.utilisation = GaugeMetricFamily(
            "gpupool_gpu_utilization_ratio",
            "Fraction of the last sample period the whole card was busy (0..1).",
            labels=GPU_LABELS,
        )
        self.pod_memory = GaugeMetricFamily(
            "gpupool_pod_gpu_memory_used_bytes",
            "GPU memory held by the pod's processes on this card.",
            labels=POD_LABELS,
        )
        self.pod_utilisation = GaugeMetricFamily(
            "gpupool_pod_compute_utilization_of_limit_ratio",
            "The pod's compute utilisation relative to its gpu-core limit "
            "(utilisation / (limit/100)), capped at 1.",
            labels=POD_LABELS,
        )

    def __iter__(self) -> Iterator[Metric]:
        return iter(vars(self).values())


class ExecutorCollector:
    """GPU and per-pod metrics of one node; pod limits come from ``projection``'s state."""

    def __init__(self, readings: ExecutorReadings, projection: Projection) -> None:
        self.readings = readings
        self.projection = projection

    def describe(self) -> Iterable[Metric]:
        return list(_ExecutorFamilies())

    def collect(self) -> Iterable[Metric]:
        families = _ExecutorFamilies()
        node = self.readings.node
        families.simulated.add_metric([node], 1 if self.readings.source == "simulated" else 0)
        processes = self.readings.pod_processes()
        pods = self.projection.state.pods
        for reading in self.readings.gpu_samples():
            labels = [node, str(reading.index), reading.uuid]
            families.memory_used.add_metric(labels, reading.memory_used_bytes)
            families.memory_total.add_metric(labels, reading.memory_total_bytes)
            families.utilisation.add_metric(labels, reading.utilisation)
            on_this_card = card_pids(reading)
            on_card = {
                ref: [pid for pid in pids if pid in on_this_card] for ref, pids in processes.items()
            }
            on_card = {ref: pids for ref, pids in on_card.items() if pids}
            for ref in sorted(on_card):
                pids = on_card[ref]
                pod_labels = [node, ref.name, ref.namespace, str(reading.index)]
                used = sum(reading.process_memory_bytes.get(pid, 0) for pid in pids)
                families.pod_memory.add_metric(pod_labels, used)
                pod = pods.get(ref)
                share = pod_utilisation(reading, pids, len(on_card))
                if pod is not None and pod.limits.core > 0 and share is not None:
                    families.pod_utilisation.add_metric(
                        pod_labels, utilisation_of_limit(share, pod.limits.core)
                    )
        return list(families)
