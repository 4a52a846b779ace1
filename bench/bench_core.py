"""Pure-core decisions per second on one 16-GPU node with 100 and with 1,000 waiting pods.

    .venv/bin/python bench/bench_core.py [--assigning-only]

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


ASSIGNING_NODES = ((1, 0), (1, 3), (16, 0), (16, 15), (16, 60))
"""(GPUs, other pods running) of the assigning-decision rows."""
ASSIGNING_REPEATS = 1500


def assigning_state(gpus: int, others: int) -> tuple[State, Envelope, Envelope]:
    """A node of ``gpus`` GPUs with ``others`` pods running (limits 10, 20, 25, 30, 50 in turn,
    each on the first GPU it fits from a rotating start) and one pod waiting that fits (limits
    15 compute / 20 memory); also the Released and PodReady that put that pod back in line
    after its Assigned (the state returns to the same usage and queue)."""
    state = State()
    node = "assign-node"
    events: list[Event] = [
        GpuInventoryReported(
            node=node,
            gpus=tuple(
                GpuInfo(index=i, uuid=f"GPU-assign-{i}", memory_mib=81920) for i in range(gpus)
            ),
            source="simulated",
        ),
        NodeConfigured(node=node, policy="share-pool", qos=QosConfig(), gpu_count=gpus),
    ]
    used = [0] * gpus
    limits = (10, 20, 25, 30, 50)
    for i in range(others):
        pod = PodRef(namespace="bench", name=f"other-{i:03d}")
        share = limits[i % len(limits)]
        gpu = next(
            (g % gpus for g in range(i, i + gpus) if used[g % gpus] + share <= 85), None
        )  # leave room for the head everywhere
        events.append(_registered_on(node, pod, Share(core=share, memory=share)))
        if gpu is not None:
            used[gpu] += share
            events += [
                PodReady(pod=pod, node=node),
                Assigned(pod=pod, node=node, gpu_index=gpu, gpu_uuid=f"GPU-assign-{gpu}"),
            ]
    head = PodRef(namespace="bench", name="head")
    events += [
        _registered_on(node, head, Share(core=15, memory=20)),
        PodReady(pod=head, node=node),
    ]
    for index, event in enumerate(events):
        evolve(state, Envelope(id=f"setup-{index}", time=START, event=event))
    assigned = decide(state, Schedule(node=node), NOW)
    assert len(assigned) == 1 and isinstance(assigned[0], Assigned), assigned
    gpu = assigned[0].gpu_index
    released = Released(
        pod=head, node=node, reason="completed", gpu_index=gpu, gpu_uuid=f"GPU-assign-{gpu}"
    )
    return (
        state,
        Envelope(id="released", time=NOW, event=released),
        Envelope(id="ready", time=NOW, event=PodReady(pod=head, node=node)),
    )


def _registered_on(node: str, pod: PodRef, limits: Share) -> PodRegistered:
    return PodRegistered(
        pod=pod,
        node=node,
        policy="share-pool",
        requests=Share(core=1, memory=1),
        limits=limits,
        priority=0,
    )


def _clear_memos(workload: bool) -> None:
    """Forget ``schedule``'s memoised GPU choices (and the node workloads, if ``workload``)."""
    deciding = sys.modules["gpupool.core.decide"]  # the module (the package exports decide())
    deciding._chosen_gpu.cache_clear()
    if workload:
        deciding._node_workload.cache_clear()


def assigning_decision(gpus: int, others: int, memo: str) -> tuple[float, float]:
    """CPU µs of one assigning decision as the admission-queue makes it on its live state:
    ``decide(state, Schedule(node))`` (the head fits: one Assigned) and ``evolve`` of the
    Assigned, and decide alone: the lowest of ROUNDS medians over ASSIGNING_REPEATS decisions
    (each timed on its own: a clock read is about 1 µs of it).

    ``memo``: "fresh" (the GPU-choice memo cleared before each decision: the first sight of
    the node's usage, as in a live service), "cold" (the node-workload memo too, as after a
    pod registered), "warm" (nothing cleared: the usage seen before)."""
    state, released, ready = assigning_state(gpus, others)
    command = Schedule(node="assign-node")
    best: tuple[float, float] | None = None
    for _ in range(ROUNDS):
        measured = _assigning_round(state, command, released, ready, memo)
        best = measured if best is None else min(best, measured)
    assert best is not None
    return best


def _assigning_round(
    state: State, command: Schedule, released: Envelope, ready: Envelope, memo: str
) -> tuple[float, float]:
    totals: list[float] = []
    decides: list[float] = []
    clock = time.process_time
    for index in range(ASSIGNING_REPEATS):
        if memo != "warm":
            _clear_memos(memo == "cold")
        started = clock()
        events = decide(state, command, NOW)
        decided = clock()
        for event in events:
            evolve(state, Envelope(id=f"a-{index}", time=NOW, event=event))
        folded = clock()
        totals.append(folded - started)
        decides.append(decided - started)
        evolve(state, released)  # back in line, untimed: the next decision sees the same usage
        evolve(state, ready)
    totals.sort()
    decides.sort()
    middle = len(totals) // 2
    return totals[middle] * 1e6, decides[middle] * 1e6


def print_assigning() -> None:
    print("one assigning decision on a live state: decide(Schedule) + evolve(Assigned), cpu us")
    print(
        f"(lowest of {ROUNDS} medians of {ASSIGNING_REPEATS}; the head fits, one Assigned; "
        "limits 10-50 running)"
    )
    print()
    header = (
        f"{'GPUs':>4}  {'running':>7}  {'fresh memo':>16}  {'cold (+workload)':>16}  "
        f"{'warm memo':>16}"
    )
    print(header)
    print("-" * len(header))
    for gpus, others in ASSIGNING_NODES:
        cells = []
        for memo in ("fresh", "cold", "warm"):
            total, decided = assigning_decision(gpus, others, memo)
            cells.append(f"{total:7.1f} ({decided:5.1f})")
        print(f"{gpus:>4}  {others:>7}  " + "  ".join(f"{cell:>16}" for cell in cells))
    print()
    print(
        "each cell: decide + evolve (decide alone). fresh: schedule's memoised GPU choices\n"
        "cleared before each decision (a usage not seen before: the live case); cold: the\n"
        "node-workload memo too (as after a pod registered); warm: a usage seen before."
    )
    print()


def main() -> int:
    started = time.perf_counter()
    print_assigning()
    if "--assigning-only" in sys.argv[1:]:
        return 0
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
