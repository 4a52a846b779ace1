"""Pooling and queue metrics computed on scrape from the projection (docs/behaviour.md)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from observability_logs import (
    exposition,
    fold,
    numbered,
    promtool_check,
    random_log,
    worked_example_log,
)
from prometheus_client import CollectorRegistry

from gpupool.events import (
    Assigned,
    Envelope,
    Event,
    GpuInfo,
    GpuInventoryReported,
    MessageRejected,
    NodeConfigured,
    PodReady,
    PodRef,
    PodRegistered,
    PodRejected,
    PodRemoved,
    Preempted,
    Released,
    Share,
)
from gpupool.observability import (
    PoolingCollector,
    Projection,
    QueueCollector,
    metrics_projection,
    metrics_registry,
)

NODE = "cn-wulanchabu-c.cr-xxx"
START = datetime(2025, 1, 1, tzinfo=UTC)


def pooling(registry: CollectorRegistry, pod: str) -> tuple[float | None, float | None]:
    labels = {"NodeName": NODE, "pod": pod, "namespace": "default"}
    return (
        registry.get_sample_value("DCGM_FI_POOLING_STATUS", labels),
        registry.get_sample_value("DCGM_FI_POOLING_POSITION", labels),
    )


def worked_example_at(seconds: float) -> Projection:
    log = [e for e in worked_example_log() if e.time <= START + timedelta(seconds=seconds)]
    return fold(numbered(log), metrics_projection())


# --------------------------------------------------------------------------- the worked example


def test_at_t1_a_and_c_run_d_heads_the_queue_and_b_waits_second() -> None:
    registry = metrics_registry(worked_example_at(3))

    assert pooling(registry, "pod-a") == (2, 0)
    assert pooling(registry, "pod-c") == (2, 0)
    assert pooling(registry, "pod-d") == (1, 1)
    assert pooling(registry, "pod-b") == (1, 2)
    assert registry.get_sample_value("gpupool_queue_length", {"node": NODE}) == 2
    allocated = {
        (gpu, resource): registry.get_sample_value(
            "gpupool_gpu_allocated_limit_percent", {"node": NODE, "gpu": gpu, "resource": resource}
        )
        for gpu in ("0", "1")
        for resource in ("core", "memory")
    }
    assert allocated == {
        ("0", "core"): 50,
        ("0", "memory"): 50,
        ("1", "core"): 100,
        ("1", "memory"): 100,
    }
    assert registry.get_sample_value("gpupool_assignments_total", {"node": NODE}) == 2
    assert registry.get_sample_value("gpupool_wait_seconds_count", {"node": NODE}) == 2


def test_at_the_end_d_and_b_run_beside_a_and_c_is_dormant() -> None:
    projection = worked_example_at(3600)
    registry = metrics_registry(projection)

    assert [pooling(registry, pod) for pod in ("pod-a", "pod-b", "pod-c", "pod-d")] == [
        (2, 0),
        (2, 0),
        (0, 0),
        (2, 0),
    ]
    assert registry.get_sample_value("gpupool_queue_length", {"node": NODE}) == 0
    assert registry.get_sample_value("gpupool_assignments_total", {"node": NODE}) == 4
    released = {"node": NODE, "reason": "completed"}
    assert registry.get_sample_value("gpupool_releases_total", released) == 1
    assert registry.get_sample_value("gpupool_log_last_sequence") == len(worked_example_log())
    enabled = {"node": NODE, "policy": "share-pool"}
    assert registry.get_sample_value("gpupool_node_enabled", enabled) == 1
    # A and C waited 0 s; D waited 2 s -> 60 s, B 3 s -> 60 s: 58 s and 57 s.
    assert registry.get_sample_value("gpupool_wait_seconds_sum", {"node": NODE}) == 115
    bucket = "gpupool_wait_seconds_bucket"
    assert registry.get_sample_value(bucket, {"node": NODE, "le": "1.0"}) == 2
    assert registry.get_sample_value(bucket, {"node": NODE, "le": "30.0"}) == 2
    assert registry.get_sample_value(bucket, {"node": NODE, "le": "60.0"}) == 4


def test_a_restart_folds_the_same_log_into_the_same_exposition() -> None:
    log = numbered(worked_example_log())
    before = exposition(metrics_registry(fold(log, metrics_projection())))

    after_restart = exposition(metrics_registry(fold(log, metrics_projection())))

    assert after_restart == before


def test_a_redelivered_log_is_not_counted_twice() -> None:
    log = numbered(worked_example_log())
    once = fold(log, metrics_projection())
    twice = fold(log, fold(log, metrics_projection()))

    assert exposition(metrics_registry(twice)) == exposition(metrics_registry(once))
    assert twice.statistics is not None
    assert twice.statistics.nodes[NODE].assignments == 4


# --------------------------------------------------------------------------- counters, exactly


def pod(name: str) -> PodRef:
    return PodRef(namespace="default", name=name)


def registration(name: str) -> PodRegistered:
    return PodRegistered(
        pod=pod(name),
        node="n1",
        policy="share-pool",
        requests=Share(core=10, memory=10),
        limits=Share(core=100, memory=100),
    )


def envelopes(timed: list[tuple[float, Event]]) -> list[Envelope]:
    return [
        Envelope(id=f"e{i}", time=START + timedelta(seconds=at), event=event)
        for i, (at, event) in enumerate(timed)
    ]


GPU = GpuInfo(index=0, uuid="GPU-0", memory_mib=1024)
COUNTED_LOG = envelopes(
    [
        (0, GpuInventoryReported(node="n1", gpus=(GPU,), source="simulated")),
        (0, NodeConfigured(node="n1", policy="share-pool", gpu_count=1)),
        *[(0, registration(name)) for name in ("p1", "p2", "p3", "p4")],
        (0, PodReady(pod=pod("p1"), node="n1")),
        (0.5, Assigned(pod=pod("p1"), node="n1", gpu_index=0, gpu_uuid="GPU-0")),
        (10, PodReady(pod=pod("p2"), node="n1")),
        (40, Released(pod=pod("p2"), node="n1", reason="cancelled")),
        (50, PodReady(pod=pod("p3"), node="n1")),
        (3650, PodRemoved(pod=pod("p3"), node="n1")),
        (100, PodReady(pod=pod("p4"), node="n1")),
        (
            17999,
            Preempted(
                victim=pod("p1"),
                preemptor=pod("p4"),
                node="n1",
                gpu_index=0,
                gpu_uuid="GPU-0",
                reason="max-duration",
            ),
        ),
        (18000, Released(pod=pod("p1"), node="n1", reason="preempted", gpu_index=0)),
        (18100, Assigned(pod=pod("p4"), node="n1", gpu_index=0, gpu_uuid="GPU-0")),
        (18101, PodRejected(pod=pod("p4"), node="n1", reason="NotDormant", message="m")),
        (18102, PodRejected(pod=pod("p4"), node="n1", reason="NotDormant", message="m")),
        (18103, PodRejected(pod=pod("zz"), node="n1", reason="UnknownPod", message="m")),
        (18104, MessageRejected(subject="gpupool.events", reason="bad", payload="{")),
        (18105, MessageRejected(subject="gpupool.events.n1", reason="bad", payload="{", node="n1")),
    ]
)


def test_counters_and_the_wait_histogram_count_exactly_what_the_log_says() -> None:
    registry = metrics_registry(fold(numbered(COUNTED_LOG), metrics_projection()))

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"node": "n1", **labels})

    assert value("gpupool_assignments_total") == 2
    assert value("gpupool_preemptions_total", reason="max-duration") == 1
    assert value("gpupool_preemptions_total", reason="priority") == 0
    assert value("gpupool_releases_total", reason="cancelled") == 1
    assert value("gpupool_releases_total", reason="preempted") == 1
    assert value("gpupool_releases_total", reason="completed") == 0
    assert value("gpupool_pod_rejections_total", reason="NotDormant") == 2
    assert value("gpupool_pod_rejections_total", reason="UnknownPod") == 1
    assert registry.get_sample_value("gpupool_rejected_messages_total") == 2
    # Waits: p1 0.5 s (assigned), p2 30 s (cancelled), p3 3600 s (removed), p4 5 h (assigned).
    assert value("gpupool_wait_seconds_count") == 4
    assert value("gpupool_wait_seconds_sum") == 21630.5
    cumulative = {
        le: value("gpupool_wait_seconds_bucket", le=le)
        for le in ("1.0", "5.0", "30.0", "60.0", "1800.0", "3600.0", "14400.0", "+Inf")
    }
    assert cumulative == {
        "1.0": 1,
        "5.0": 1,
        "30.0": 2,
        "60.0": 2,
        "1800.0": 2,
        "3600.0": 3,
        "14400.0": 3,
        "+Inf": 4,
    }


def test_the_queue_collector_needs_a_projection_that_keeps_statistics() -> None:
    with pytest.raises(ValueError, match="metrics_projection"):
        QueueCollector(Projection())


def test_a_registry_without_the_queue_metrics_exports_none_of_them() -> None:
    registry = metrics_registry(fold(numbered(COUNTED_LOG), Projection()), queue=False)

    assert exposition(registry) == ""


# --------------------------------------------------------------------------- promtool


SPEC_FIXED_LINT = {
    f"{name} label names should be written in 'snake_case' not 'camelCase'"
    for name in ("DCGM_FI_POOLING_STATUS", "DCGM_FI_POOLING_POSITION")
}
"""docs/behaviour.md fixes the label ``NodeName``; promtool's style lint objects to it, and
that is the only objection allowed."""


def registry_of(collector: PoolingCollector | QueueCollector) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(collector)
    return registry


@pytest.mark.prometheus
def test_promtool_accepts_the_queue_metrics() -> None:
    projection = fold(random_log(3), metrics_projection())
    text = exposition(registry_of(QueueCollector(projection)))

    assert "gpupool_wait_seconds_bucket" in text
    assert promtool_check(text) == (0, set())


@pytest.mark.prometheus
def test_promtool_finds_nothing_but_the_spec_fixed_label_name_in_the_pooling_metrics() -> None:
    projection = fold(random_log(3), metrics_projection())
    text = exposition(registry_of(PoolingCollector(projection)))

    returncode, problems = promtool_check(text)

    assert "DCGM_FI_POOLING_POSITION{NodeName=" in text
    assert returncode in (0, 3), problems  # 3: lint findings only, the text parses
    assert problems <= SPEC_FIXED_LINT


@pytest.mark.prometheus
def test_promtool_rejects_a_broken_exposition() -> None:
    """The check above can fail: promtool does object to what is wrong."""
    returncode, problems = promtool_check("# TYPE gpupool_x counter\ngpupool_x 1\n")

    assert returncode != 0
    assert problems
