"""Which metrics each service serves (wired in one place)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from gpupool.observability.projection import Projection


def service_registry(projection: Projection) -> CollectorRegistry:
    return CollectorRegistry()


def executor_registry(projection: Projection, executor: Any) -> CollectorRegistry:
    return CollectorRegistry()
