"""Prometheus collectors computed on scrape from the projection (docs/metrics.md lists every metric).

Nothing here counts by itself: gauges are read from the folded state and counters
from the statistics folded from the log, so a restart or a replay can never
double-count. Call ``collect`` (through ``generate_latest``) on the thread that
folds the projection, e.g. from the service's event loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import get_args

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from gpupool.core import PodState, State, pooling_position, pooling_status, queue_positions
from gpupool.events import PreemptReason, ReleaseReason
from gpupool.observability.executor_metrics import ExecutorCollector, ExecutorReadings
from gpupool.observability.pod_gpu_metrics import PodGpuCollector
from gpupool.runtime.projection import Projection
from gpupool.runtime.statistics import LogStatistics

POOLING_STATUS = "DCGM_FI_POOLING_STATUS"
POOLING_POSITION = "DCGM_FI_POOLING_POSITION"
POOLING_LABELS = ("NodeName", "pod", "namespace")
"""Names and label names fixed by docs/behaviour.md (hence not Prometheus style)."""

PREEMPT_REASONS: tuple[str, ...] = get_args(PreemptReason)
RELEASE_REASONS: tuple[str, ...] = get_args(ReleaseReason)


class PoolingCollector:
    """``DCGM_FI_POOLING_STATUS`` and ``DCGM_FI_POOLING_POSITION`` for every registered pod."""

    def __init__(self, projection: Projection) -> None:
        self.projection = projection

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterable[Metric]:
        state = self.projection.state
        status, position = families = self._families()
        positions = {node: queue_positions(state, node) for node in state.nodes}
        for pod in state.pods.values():
            labels = [pod.node, pod.ref.name, pod.ref.namespace]
            status.add_metric(labels, pooling_status(pod))
            position.add_metric(labels, pooling_position(positions.get(pod.node, {}), pod.ref))
        return families

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily(
                POOLING_STATUS,
                "Pooling state of a GPU-sharing pod: 0 dormant, 1 ready (waiting), 2 running.",
                labels=POOLING_LABELS,
            ),
            GaugeMetricFamily(
                POOLING_POSITION,
                "Position of a GPU-sharing pod in its node's ready queue: 1 is the head, "
                "0 not waiting.",
                labels=POOLING_LABELS,
            ),
        )


class QueueCollector:
    """Queue lengths, GPU allocation by limits, node enablement, and the counters folded from the log."""

    def __init__(self, projection: Projection) -> None:
        if projection.statistics is None:
            raise ValueError(
                "QueueCollector needs a projection that keeps statistics "
                "(build it with metrics_projection())"
            )
        self.projection = projection

    def describe(self) -> Iterable[Metric]:
        return list(_QueueFamilies())

    def collect(self) -> Iterable[Metric]:
        projection = self.projection
        statistics = projection.statistics
        assert statistics is not None
        families = _QueueFamilies()
        _add_state(families, projection.state)
        _add_statistics(families, statistics)
        families.log_last_sequence.add_metric([], projection.last_seq)
        families.undecodable.add_metric([], projection.undecodable)
        return list(families)


class _QueueFamilies:
    def __init__(self) -> None:
        self.queue_length = GaugeMetricFamily(
            "gpupool_queue_length", "Pods waiting in the node's ready queue.", labels=["node"]
        )
        self.wait_seconds = HistogramMetricFamily(
            "gpupool_wait_seconds",
            "Time pods spent in the ready queue, from PodReady to the entry that ended the "
            "wait (Assigned, or Released/PodRemoved while waiting), by the log's times.",
            labels=["node"],
        )
        self.assignments = CounterMetricFamily(
            "gpupool_assignments", "Assigned events: a pod was given a GPU.", labels=["node"]
        )
        self.preemptions = CounterMetricFamily(
            "gpupool_preemptions",
            "Preempted events, by reason (priority, max-duration).",
            labels=["node", "reason"],
        )
        self.releases = CounterMetricFamily(
            "gpupool_releases",
            "Released events: a pod left its GPU or the queue, by reason.",
            labels=["node", "reason"],
        )
        self.pod_rejections = CounterMetricFamily(
            "gpupool_pod_rejections",
            "PodRejected events: a pod or a request for it was refused, by reason.",
            labels=["node", "reason"],
        )
        self.rejected_messages = CounterMetricFamily(
            "gpupool_rejected_messages",
            "MessageRejected events: messages on event subjects that could not be read.",
        )
        self.allocated_limit = GaugeMetricFamily(
            "gpupool_gpu_allocated_limit_percent",
            "Sum of the limits of the pods running on the GPU, percent of one GPU "
            "(resource: core or memory).",
            labels=["node", "gpu", "resource"],
        )
        self.node_enabled = GaugeMetricFamily(
            "gpupool_node_enabled",
            "1 if GPU sharing is enabled on the node with this policy, 0 if disabled "
            "(policy none).",
            labels=["node", "policy"],
        )
        self.log_last_sequence = GaugeMetricFamily(
            "gpupool_log_last_sequence",
            "Stream sequence up to which this projection has applied the log.",
        )
        self.undecodable = CounterMetricFamily(
            "gpupool_log_undecodable_entries",
            "Log entries this projection could not decode and skipped.",
        )

    def __iter__(self) -> Iterator[Metric]:
        return iter(vars(self).values())


def _running_limits(node_gpus: Iterable[int], pods: Iterable[PodState]) -> dict[int, list[int]]:
    """Per GPU index: [core, memory] sums of the limits of the pods running there (any policy)."""
    usage = {index: [0, 0] for index in node_gpus}
    for pod in pods:
        if pod.phase == "running" and pod.gpu_index is not None:
            held = usage.setdefault(pod.gpu_index, [0, 0])
            held[0] += pod.limits.core
            held[1] += pod.limits.memory
    return usage


def _add_state(families: _QueueFamilies, state: State) -> None:
    waiting: dict[str, int] = dict.fromkeys(state.nodes, 0)
    for pod in state.pods.values():
        if pod.phase == "ready":
            waiting[pod.node] = waiting.get(pod.node, 0) + 1
    for name, node in state.nodes.items():
        families.queue_length.add_metric([name], waiting[name])
        families.node_enabled.add_metric([name, node.policy or "none"], 1 if node.enabled else 0)
        usage = _running_limits((gpu.index for gpu in node.gpus), state.pods_on(name))
        for index in sorted(usage):
            core, memory = usage[index]
            families.allocated_limit.add_metric([name, str(index), "core"], core)
            families.allocated_limit.add_metric([name, str(index), "memory"], memory)


def _add_statistics(families: _QueueFamilies, statistics: LogStatistics) -> None:
    for name in sorted(statistics.nodes):
        stats = statistics.nodes[name]
        families.assignments.add_metric([name], stats.assignments)
        for reason in _reasons(PREEMPT_REASONS, stats.preemptions):
            families.preemptions.add_metric([name, reason], stats.preemptions.get(reason, 0))
        for reason in _reasons(RELEASE_REASONS, stats.releases):
            families.releases.add_metric([name, reason], stats.releases.get(reason, 0))
        for reason in sorted(stats.pod_rejections):
            families.pod_rejections.add_metric([name, reason], stats.pod_rejections[reason])
        families.wait_seconds.add_metric(
            [name], buckets=stats.waits.cumulative(), sum_value=stats.waits.sum_seconds
        )
    families.rejected_messages.add_metric([], statistics.rejected_messages)


def _reasons(known: tuple[str, ...], seen: dict[str, int]) -> list[str]:
    """Every known reason (exported at 0 until it happens), then any other the log holds."""
    return [*known, *sorted(set(seen) - set(known))]


def metrics_registry(
    projection: Projection,
    *,
    queue: bool = True,
    executor: ExecutorReadings | None = None,
) -> CollectorRegistry:
    """A registry for ``generate_latest``.

    ``queue``: the pooling and queue metrics (the admission-queue service; the
    projection must come from :func:`metrics_projection`). ``executor``: the
    node-executor's GPU and pod metrics, read through that port.
    """
    registry = CollectorRegistry()
    if queue:
        registry.register(PoolingCollector(projection))
        registry.register(QueueCollector(projection))
        registry.register(PodGpuCollector(projection))
    if executor is not None:
        registry.register(ExecutorCollector(executor, projection))
    return registry


__all__ = [
    "POOLING_LABELS",
    "POOLING_POSITION",
    "POOLING_STATUS",
    "PoolingCollector",
    "QueueCollector",
    "metrics_registry",
]
