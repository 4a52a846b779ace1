"""The audit read models (``gpupool.audit``) on the two simulated logs, with exact values.

Worked example (scenarios/worked-example.yaml): A on GPU 0 at +0s, C on GPU 1 at
+1s, D ready at +2s (head), B at +3s (position 2); C completes at +60s, D gets
GPU 1, B GPU 0 beside A. Preemption (scenarios/preemption-priority.yaml):
serving/infer (priority 1000) preempts train-1 on GPU 0 at +60s; train-1 requeues
and gets GPU 1 at +75s when train-2 completes; train-3 gets GPU 0 at +90s.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

import pytest

from gpupool.audit import (
    AuditError,
    GpuInterval,
    LogFilter,
    estimate_wait,
    explain,
    fold_until,
    gpu_intervals,
    log_origin,
    parse_pod,
    pod_history,
    preemptions,
    select_entries,
    state_at,
)
from gpupool.cli.log_source import file_entry
from gpupool.cli.main import main
from gpupool.eventlog.port import Entry
from gpupool.events import PodRef

ROOT = Path(__file__).resolve().parents[2]
NODE = "cn-wulanchabu-c.cr-xxx"


def pod(name: str) -> PodRef:
    return parse_pod(name)


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Entry]]:
    directory = tmp_path_factory.mktemp("logs")
    made = {}
    for name in ("worked-example", "preemption-priority"):
        target = directory / f"{name}.jsonl"
        assert main(["simulate", str(ROOT / "scenarios" / f"{name}.yaml"), "-o", str(target)]) == 0
        lines = target.read_bytes().splitlines(keepends=True)
        made[name] = [
            file_entry(seq, line, subject_prefix="gpupool") for seq, line in enumerate(lines, 1)
        ]
    return made


def at(entries: list[Entry], seconds: float) -> datetime:
    origin = log_origin(entries)
    assert origin is not None
    return origin + timedelta(seconds=seconds)


def spans(entries: list[Entry], intervals: list[GpuInterval]) -> list[tuple[object, ...]]:
    origin = log_origin(entries)
    assert origin is not None
    return [
        (
            i.pod.name,
            i.gpu_index,
            (i.start - origin).total_seconds(),
            None if i.end is None else (i.end - origin).total_seconds(),
            i.ended,
            None if i.preempted_by is None else str(i.preempted_by),
        )
        for i in intervals
    ]


# --------------------------------------------------------------------------- GPU occupancy


def test_gpu_intervals_of_the_worked_example(logs: dict[str, list[Entry]]) -> None:
    entries = logs["worked-example"]
    assert spans(entries, gpu_intervals(entries)) == [
        ("pod-a", 0, 0.0, None, "holding", None),
        ("pod-c", 1, 1.0, 60.0, "completed", None),
        ("pod-d", 1, 60.0, None, "holding", None),
        ("pod-b", 0, 60.0, None, "holding", None),
    ]


def test_gpu_intervals_of_the_preemption_scenario(logs: dict[str, list[Entry]]) -> None:
    entries = logs["preemption-priority"]
    assert spans(entries, gpu_intervals(entries)) == [
        ("train-1", 0, 0.0, 60.0, "preempted", "serving/infer"),
        ("train-2", 1, 5.0, 75.0, "completed", None),
        ("infer", 0, 60.0, 90.0, "completed", None),
        ("train-1", 1, 75.0, 200.0, "completed", None),
        ("train-3", 0, 90.0, 300.0, "completed", None),
    ]


def test_gpu_intervals_in_a_past_window_end_at_its_end(logs: dict[str, list[Entry]]) -> None:
    """A window [+70s, +80s]: only what overlaps it, and what is open at +80s is holding."""
    entries = logs["preemption-priority"]
    window = gpu_intervals(entries, since=at(entries, 70), until=at(entries, 80))
    assert spans(entries, window) == [
        ("train-2", 1, 5.0, 75.0, "completed", None),
        ("infer", 0, 60.0, None, "holding", None),
        ("train-1", 1, 75.0, None, "holding", None),
    ]


# --------------------------------------------------------------------------- queue and state


def test_queue_positions_and_waits_at_t1(logs: dict[str, list[Entry]]) -> None:
    entries = logs["worked-example"]
    view = state_at(entries, at(entries, 5))
    (node,) = view.nodes
    assert [(q.position, q.pod.name, q.waited) for q in node.queue] == [
        (1, "pod-d", timedelta(seconds=3)),
        (2, "pod-b", timedelta(seconds=2)),
    ]
    assert [(g.index, [s.pod.name for s in g.pods]) for g in node.gpus] == [
        (0, ["pod-a"]),
        (1, ["pod-c"]),
    ]
    # no hold has completed yet: no estimate
    assert all(q.estimate is not None and q.estimate.wait is None for q in node.queue)


def test_state_at_t2_has_an_empty_queue(logs: dict[str, list[Entry]]) -> None:
    entries = logs["worked-example"]
    (node,) = state_at(entries, at(entries, 60)).nodes
    assert node.queue == []
    assert [(g.index, sorted(s.pod.name for s in g.pods)) for g in node.gpus] == [
        (0, ["pod-a", "pod-b"]),
        (1, ["pod-d"]),
    ]


def test_state_at_none_is_the_whole_log_at_its_last_entry(logs: dict[str, list[Entry]]) -> None:
    entries = logs["worked-example"]
    view = state_at(entries)
    assert view.at == at(entries, 60)
    assert view.entries == len(entries)


def test_queue_eta_from_recent_holds(logs: dict[str, list[Entry]]) -> None:
    """At +80s train-2 has completed after 70s on its GPU: 70s × 1 / 2 GPUs = 35s for train-3."""
    entries = logs["preemption-priority"]
    (node,) = state_at(entries, at(entries, 80)).nodes
    (queued,) = node.queue
    assert queued.pod.name == "train-3"
    assert queued.estimate is not None
    assert queued.estimate.median_hold == timedelta(seconds=70)
    assert queued.estimate.wait == timedelta(seconds=35)


def test_state_of_an_unknown_node_is_an_audit_error(logs: dict[str, list[Entry]]) -> None:
    with pytest.raises(AuditError, match="node 'nope' is not in the log"):
        state_at(logs["worked-example"], None, "nope")


# --------------------------------------------------------------------------- preemptions


def test_preemptions_with_both_sides(logs: dict[str, list[Entry]]) -> None:
    entries = logs["preemption-priority"]
    (record,) = preemptions(entries)
    assert (record.seq, record.gpu_index, record.reason) == (12, 0, "priority")
    assert (record.victim, record.victim_priority, record.victim_held) == (
        pod("default/train-1"),
        0,
        timedelta(seconds=60),
    )
    assert (record.preemptor, record.preemptor_priority, record.preemptor_waited) == (
        pod("serving/infer"),
        1000,
        timedelta(0),
    )
    assert record.victim_released_at == at(entries, 60)
    assert (record.preemptor_assigned_at, record.preemptor_gpu) == (at(entries, 60), 0)


def test_no_preemptions_in_the_worked_example(logs: dict[str, list[Entry]]) -> None:
    assert preemptions(logs["worked-example"]) == []


# --------------------------------------------------------------------------- history


def test_history_steps_of_b(logs: dict[str, list[Entry]]) -> None:
    history = pod_history(logs["worked-example"], pod("pod-b"))
    assert [(s.seq, s.kind, s.position, s.gpu_index) for s in history.steps] == [
        (4, "registered", None, None),
        (12, "ready", 2, None),
        (14, "moved", 1, None),
        (15, "assigned", None, 0),
    ]
    moved, assigned = history.steps[2], history.steps[3]
    assert moved.cause is not None and (moved.cause.pod, moved.cause.what) == (
        pod("pod-d"),
        "assigned",
    )
    assert (assigned.waited, assigned.positions) == (timedelta(seconds=57), [2, 1])


def test_history_steps_of_the_preempted_pod(logs: dict[str, list[Entry]]) -> None:
    history = pod_history(logs["preemption-priority"], pod("train-1"))
    assert [(s.seq, s.kind) for s in history.steps] == [
        (3, "registered"),
        (7, "ready"),
        (8, "assigned"),
        (12, "preempted"),
        (13, "released"),
        (14, "ready"),
        (15, "moved"),
        (18, "assigned"),
        (21, "released"),
    ]
    preempted = history.steps[3]
    assert (preempted.other, preempted.held) == (pod("serving/infer"), timedelta(seconds=60))


def test_history_of_an_unknown_pod_is_an_audit_error(logs: dict[str, list[Entry]]) -> None:
    with pytest.raises(AuditError, match="does not appear"):
        pod_history(logs["worked-example"], pod("nobody"))


# --------------------------------------------------------------------------- log, estimate


def test_log_selection_by_pod_matches_both_sides_of_a_preemption(
    logs: dict[str, list[Entry]],
) -> None:
    chosen = select_entries(
        logs["preemption-priority"],
        LogFilter(pod=pod("serving/infer"), types=frozenset({"Preempted"})),
    )
    assert [entry.seq for entry in chosen] == [12]


def test_wait_estimate_is_median_hold_times_position_over_gpus(
    logs: dict[str, list[Entry]],
) -> None:
    entries = logs["preemption-priority"]
    folded = fold_until(
        entries
    )  # completed holds: train-2 70s, infer 30s, train-1 125s, train-3 210s
    node = folded.state.nodes["gpu-node-1"]
    estimate = estimate_wait(node, 3, folded.holds)
    assert (estimate.sample, estimate.median_hold) == (4, timedelta(seconds=97.5))
    assert estimate.wait == timedelta(seconds=97.5) * 3 / 2


# --------------------------------------------------------------------------- explain


def test_explanation_of_d_at_t1_from_the_diagnosis(logs: dict[str, list[Entry]]) -> None:
    entries = logs["worked-example"]
    explanation = explain(entries, pod("pod-d"), at(entries, 5))
    assert (explanation.phase, explanation.position, explanation.verdict) == (
        "waiting",
        1,
        "no-eligible-victim",
    )
    assert [(r.kind, r.gpu_index, r.why) for r in explanation.reasons] == [
        ("gpu-too-full", 0, ""),
        ("gpu-too-full", 1, ""),
        ("head-fits-nowhere", None, ""),
        ("victim-protected", 0, "same-priority-held-too-briefly"),
        ("victim-protected", 1, "same-priority-held-too-briefly"),
        ("next-check", None, ""),
    ]


def test_explanation_names_the_eligible_victim_before_the_preemption(
    logs: dict[str, list[Entry]],
) -> None:
    """Just before #12 the planner picks train-1 (the longest hold) on GPU 0 for infer."""
    entries = logs["preemption-priority"]
    before = [e for e in entries if e.seq <= 11]
    explanation = explain(before, pod("serving/infer"))
    assert explanation.verdict == "preemption-due"
    eligible = [(r.pod, r.why) for r in explanation.reasons if r.kind == "victim-eligible"]
    assert eligible == [(pod("train-1"), "priority"), (pod("train-2"), "priority")]
    (due,) = [r for r in explanation.reasons if r.kind == "preemption-due"]
    assert (due.gpu_index, due.victims) == (0, [pod("train-1")])
