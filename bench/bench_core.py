"""Pure-core decisions per second on one 16-GPU node with 100 and with 1,000 waiting pods.

    .venv/bin/python bench/bench_core.py

Every GPU holds a running pod with limit 100, so no waiting pod fits: that is the
state in which admission-queue and preemption decide after every event of a node.
Measured, for each queue length:

* Schedule, head blocked (strict order: the common case, nothing to assign);
* Schedule, head blocked, backfill on (every later pod is tried);
* Schedule, one GPU free (one Assigned decided);
* PlanPreemption, no victim (equal priorities, under podMaxDurationMinutes);
* PlanPreemption, a plan (the head outranks the running pods);
* evolve of a PodReady + Released(cancelled) pair (per event).

The baseline, measured in the same run on the same state, is the cost of
building the node's ready queue in order (``ready_queue``: filter and sort), which
every decision needs; each row shows its cost as a multiple of it. A second
baseline for evolve is folding a PodReady alone.

Prints a table; no assertions (the numbers depend on the machine).
"""

from __future__ import annotations

import copy
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial

from gpupool.core import (
    PlanPreemption,
    Schedule,
    State,
    decide,
    evolve,
    ready_queue,
)
from gpupool.events import (
    Assigned,
    Envelope,
    Event,
    GpuInfo,
    GpuInventoryReported,
    NodeConfigured,
    PodReady,
    PodRef,
    PodRegistered,
    QosConfig,
    Released,
    Share,
)

NODE = "bench-node"
GPUS = 16
QUEUES = (100, 1000)
START = datetime(2025, 1, 1, tzinfo=UTC)
NOW = START + timedelta(minutes=30)
MIN_SECONDS = 0.25
ROUNDS = 3


def build_state(waiting: int, *, backfill: bool = False, head_priority: int = 0) -> State:
    """16 GPUs each held by one pod (limit 100); ``waiting`` pods queued behind (limit 100)."""
    state = State()
    qos = QosConfig(preempt_enabled=True, pod_max_duration_minutes=120, backfill=backfill)
    events: list[Event] = [
        GpuInventoryReported(
            node=NODE,
            gpus=tuple(
                GpuInfo(index=i, uuid=f"GPU-bench-{i}", memory_mib=81920) for i in range(GPUS)
            ),
            source="simulated",
        ),
        NodeConfigured(node=NODE, policy="share-pool", qos=qos, gpu_count=GPUS),
    ]
    for i in range(GPUS):
        pod = PodRef(namespace="bench", name=f"running-{i:02d}")
        events += [
            _registered(pod, priority=0),
            PodReady(pod=pod, node=NODE),
            Assigned(pod=pod, node=NODE, gpu_index=i, gpu_uuid=f"GPU-bench-{i}"),
        ]
    for i in range(waiting):
        pod = PodRef(namespace="bench", name=f"waiting-{i:04d}")
        priority = head_priority if i == 0 else i % 3 - 3  # a mix of priorities below the head's
        events += [_registered(pod, priority=priority), PodReady(pod=pod, node=NODE)]
    for index, event in enumerate(events):
        evolve(state, Envelope(id=f"setup-{index}", time=START, event=event))
    return state


def _registered(pod: PodRef, *, priority: int) -> PodRegistered:
    return PodRegistered(
        pod=pod,
        node=NODE,
        policy="share-pool",
        requests=Share(core=1, memory=1),
        limits=Share(core=100, memory=100),
        priority=priority,
    )


def free_gpu(state: State) -> State:
    freed = copy.deepcopy(state)
    pod = PodRef(namespace="bench", name="running-00")
    released = Released(pod=pod, node=NODE, reason="completed", gpu_index=0, gpu_uuid="GPU-bench-0")
    evolve(freed, Envelope(id="free", time=START, event=released))
    return freed


def rate(operation: Callable[[], object], per_call: int = 1) -> float:
    """Best of ROUNDS runs of at least MIN_SECONDS of this process's CPU time each: operations
    per CPU-second (on a shared machine other processes' load inflates wall time, not this)."""
    best = 0.0
    calls = 1
    while True:  # calibrate a batch size that takes a measurable time
        started = time.process_time()
        for _ in range(calls):
            operation()
        if time.process_time() - started > MIN_SECONDS / 10:
            break
        calls *= 2
    for _ in range(ROUNDS):
        done = 0
        started = time.process_time()
        while (elapsed := time.process_time() - started) < MIN_SECONDS:
            for _ in range(calls):
                operation()
            done += calls
        best = max(best, done * per_call / elapsed)
    return best


@dataclass(frozen=True)
class Row:
    waiting: int
    name: str
    per_second: float
    baseline: float

    @property
    def cost(self) -> float:
        """Time per operation as a multiple of the baseline's."""
        return self.baseline / self.per_second


def measure(waiting: int) -> list[Row]:
    strict = build_state(waiting)
    backfill = build_state(waiting, backfill=True)
    outranked = build_state(waiting, head_priority=5)
    one_free = free_gpu(strict)

    def check(state: State, command: Schedule | PlanPreemption, expected: int) -> None:
        decided = decide(state, command, NOW)
        assert len(decided) == expected, (command, decided)  # the bench measures what it says

    check(strict, Schedule(node=NODE), 0)
    check(one_free, Schedule(node=NODE), 1)
    check(strict, PlanPreemption(node=NODE), 0)
    check(outranked, PlanPreemption(node=NODE), 1)

    baseline = rate(lambda: ready_queue(strict, NODE))
    rows = [Row(waiting, "baseline: ready_queue (filter + sort)", baseline, baseline)]
    decisions: list[tuple[str, State, Schedule | PlanPreemption]] = [
        ("Schedule, head blocked", strict, Schedule(node=NODE)),
        ("Schedule, head blocked, backfill", backfill, Schedule(node=NODE)),
        ("Schedule, one GPU free (1 Assigned)", one_free, Schedule(node=NODE)),
        ("PlanPreemption, no victim", strict, PlanPreemption(node=NODE)),
        ("PlanPreemption, a plan (1 Preempted)", outranked, PlanPreemption(node=NODE)),
    ]
    for name, state, command in decisions:
        rows.append(Row(waiting, name, rate(partial(decide, state, command, NOW)), baseline))

    # evolve: a dormant pod becomes ready and cancels, over and over (the state is unchanged
    # after each pair, so the queue length stays the same).
    folded = copy.deepcopy(strict)
    pod = PodRef(namespace="bench", name="bench-cycler")
    evolve(folded, Envelope(id="r", time=START, event=_registered(pod, priority=0)))
    ready = Envelope(id="ready", time=NOW, event=PodReady(pod=pod, node=NODE))
    cancelled = Envelope(
        id="cancel", time=NOW, event=Released(pod=pod, node=NODE, reason="cancelled")
    )

    def ready_and_cancel() -> None:
        evolve(folded, ready)
        evolve(folded, cancelled)

    # The evolve baseline: folding the same PodReady again and again (no Released).
    ready_only = copy.deepcopy(folded)
    fold_baseline = rate(lambda: evolve(ready_only, ready))
    rows.append(Row(waiting, "baseline: evolve PodReady alone", fold_baseline, fold_baseline))
    pair = rate(ready_and_cancel, 2)
    rows.append(Row(waiting, "evolve PodReady + Released (per event)", pair, fold_baseline))
    return rows


def main() -> int:
    started = time.perf_counter()
    rows = [row for waiting in QUEUES for row in measure(waiting)]
    print(f"gpupool core decisions, one node of {GPUS} GPUs, every GPU held (limit 100)")
    print(f"Python {sys.version.split()[0]}; best of {ROUNDS} runs of >= {MIN_SECONDS} cpu-s each")
    print()
    header = (
        f"{'waiting':>7}  {'operation':<40}  {'per second':>12}  {'us each':>9}  {'x baseline':>10}"
    )
    print(header)
    print("-" * len(header))
    for index, row in enumerate(rows):
        if row.name.startswith("baseline") and index > 0:
            print()
        print(
            f"{row.waiting:>7}  {row.name:<40}  {row.per_second:>12,.0f}  "
            f"{1e6 / row.per_second:>9.1f}  {row.cost:>10.2f}"
        )
    print()
    print(
        "x baseline: the operation's time as a multiple of the baseline above it, measured in\n"
        "this run on the same state (decisions: building the ordered ready queue; evolve:\n"
        "folding a PodReady alone)."
    )
    print(f"total {time.perf_counter() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
