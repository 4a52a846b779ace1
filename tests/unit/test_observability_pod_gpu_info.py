"""``gpupool_pod_gpu_info``: one series per pod holding a GPU, now; none for the others.

Worked example: at T1 (+5s) A holds GPU 0 and C GPU 1 (D and B wait: no series); at
T2 (+60s) C has completed and left, D holds GPU 1 and B GPU 0 beside A. On a long
random log the series are exactly the current holdings (bounded cardinality).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from observability_logs import fold, numbered, random_log, worked_example_log
from prometheus_client import CollectorRegistry

from gpupool.observability import Projection, metrics_projection, metrics_registry
from gpupool.observability.pod_gpu_metrics import POD_GPU_INFO, PodGpuCollector

NODE = "cn-wulanchabu-c.cr-xxx"
START = datetime(2025, 1, 1, tzinfo=UTC)


def holdings(registry: CollectorRegistry) -> list[tuple[str, str, str, str, str]]:
    return sorted(
        (
            s.labels["node"],
            s.labels["namespace"],
            s.labels["pod"],
            s.labels["gpu"],
            s.labels["uuid"],
        )
        for family in registry.collect()
        if family.name == POD_GPU_INFO
        for s in family.samples
        if s.value == 1
    )


def at(seconds: float) -> Projection:
    log = [e for e in worked_example_log() if e.time <= START + timedelta(seconds=seconds)]
    return fold(numbered(log), metrics_projection())


def uuid(gpu: int) -> str:
    return f"GPU-SIMULATED-{NODE}-{gpu}"


def test_at_t1_only_the_running_pods_hold_gpus() -> None:
    assert holdings(metrics_registry(at(5))) == [
        (NODE, "default", "pod-a", "0", uuid(0)),
        (NODE, "default", "pod-c", "1", uuid(1)),
    ]


def test_at_t2_d_holds_gpu_1_and_b_gpu_0_beside_a() -> None:
    assert holdings(metrics_registry(at(60))) == [
        (NODE, "default", "pod-a", "0", uuid(0)),
        (NODE, "default", "pod-b", "0", uuid(0)),
        (NODE, "default", "pod-d", "1", uuid(1)),
    ]


def test_series_are_exactly_the_current_holdings_on_a_long_log() -> None:
    projection = fold(random_log(7), metrics_projection())
    registry = CollectorRegistry()
    registry.register(PodGpuCollector(projection))
    state = projection.state
    expected = sorted(
        (p.node, p.ref.namespace, p.ref.name, str(p.gpu_index))
        for p in state.pods.values()
        if p.gpu_index is not None and (p.phase == "running" or p.policy == "static")
    )
    assert [h[:4] for h in holdings(registry)] == expected
    assert len(expected) < len(state.pods)  # not one series per pod ever seen
