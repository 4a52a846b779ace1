"""Which metrics each service serves (wired in one place).

* admission-queue: ``DCGM_FI_POOLING_STATUS``/``POSITION`` and the queue metrics, computed on
  scrape from its projection (which must fold the statistics: :func:`metrics_projection`);
* node-executor: the GPU and pod-process figures and whether the inventory is simulated;
* every service: its own readiness, conflicts and applied sequence (gpupool.runtime.service).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from gpupool.observability.executor_metrics import ExecutorReadings
from gpupool.observability.metrics import metrics_registry
from gpupool.runtime.projection import Projection, metrics_projection

__all__ = ["executor_registry", "metrics_projection", "queue_registry"]


def queue_registry(projection: Projection) -> CollectorRegistry:
    return metrics_registry(projection)


def executor_registry(projection: Projection, readings: ExecutorReadings) -> CollectorRegistry:
    return metrics_registry(projection, queue=False, executor=readings)
