"""gpupool's placement with departures: the openb default trace replayed by its own
``creation_time`` / ``deletion_time`` through the share-pool model, against BestFit and an
FGD reference built in the same harness.

    .venv/bin/python bench/bench_openb_departures.py [--traces DIR] [--seeds 3]
        [--capacity 0.5,0.75] [--workers N]

No published figure exists for this experiment; the table is ours (docs/benchmarks.md).

Method. Every pod of ``openb_pod_list_default.csv`` arrives at its ``creation_time`` and,
once started, runs for as long as it ran in the trace (``deletion_time`` less
``scheduled_time``, or less ``creation_time`` when it was never scheduled; at least 1 s).
The trace's own concurrency peaks at about 66 GPUs, far below the 6,212 GPUs of its
cluster, so the cluster is a seeded sample of the trace's GPU nodes holding
``capacity`` × the peak GPU demand (``--capacity``, several values): without contention
every placement is the same. Times are the trace's, unchanged.

* gpupool (bench_openb's ``GpupoolPlacement``: the extender's filter and score, the
  core's GPU choice). A pod the extender sends to a node where no GPU fits by limits is
  bound and waits in that node's ready queue, served in strict order whenever a pod on
  the node leaves (the head gets ``choose_gpu``; the queue stops at the first pod that
  does not fit). A pod no node admits (by CPU, memory or share requests) stays pending
  in the scheduler and is tried again, in arrival order, after every departure.
* BestFit (the published simulator's, from bench_openb) and FGD (bench_openb's
  ``FgdPlacement``: the paper's measure over the whole trace's workload, random ties):
  a pod starts where it fits now or stays pending in the scheduler, tried again in
  arrival order after every departure.

Reported per policy and capacity, medians over the seeds: the GPU allocation over time
(time-weighted mean of the GPUs held, % of capacity, over the whole replay and over the
hours when the trace's own demand exceeds the capacity), the wait from arrival to start
(p50, p99, seconds, over the pods that started), the pods never started when the
trace ends, and of the pods, those that fit no node of the sample even empty (the
trace's 8-GPU pods asking 120 CPUs, where the sample has no 8-GPU node with that many
CPUs): they can never start under any policy. Prints tables; no assertions.
"""

from __future__ import annotations

import argparse
import csv
import heapq
import importlib.util
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec

from gpupool.core.fragmentation import Task, Workload
from gpupool.core.placement import add, choose_gpu, subtract


def _load_openb() -> ModuleType:
    path = Path(__file__).resolve().with_name("bench_openb.py")
    spec = importlib.util.spec_from_file_location("bench_openb", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


openb = _load_openb()
POD_FILE = "openb_pod_list_default.csv"
POLICIES = ("gpupool", "BestFit", "FGD (this harness)")
HOUR = 3600


class TimedPod(msgspec.Struct, frozen=True, kw_only=True):
    pod: Any
    """bench_openb.TracePod"""
    arrival: int
    runs_for: int


def read_timed(path: Path) -> list[TimedPod]:
    timed: list[TimedPod] = []
    by_name = {pod.name: pod for pod in openb.read_pods(path)}
    with path.open(newline="") as file:
        for row in csv.DictReader(file):
            created = int(row["creation_time"] or 0)
            deleted = int(row["deletion_time"] or created)
            scheduled = int(row["scheduled_time"] or 0)
            begin = scheduled if scheduled > created else created
            timed.append(
                TimedPod(
                    pod=by_name[row["name"]], arrival=created, runs_for=max(1, deleted - begin)
                )
            )
    timed.sort(key=lambda t: (t.arrival, t.pod.name))
    return timed


def demand_profile(timed: Sequence[TimedPod]) -> list[tuple[int, int]]:
    """(time, GPU milli present) steps of the trace's own concurrency."""
    steps: list[tuple[int, int]] = []
    for t in timed:
        demand = t.pod.gpu_demand_milli
        steps += [(t.arrival, demand), (t.arrival + t.runs_for, -demand)]
    steps.sort()
    present, profile = 0, []
    for moment, change in steps:
        present += change
        profile.append((moment, present))
    return profile


def sample_nodes(nodes: Sequence[Any], gpus: int, seed: int) -> list[Any]:
    """Nodes drawn (seeded, without replacement) until they hold at least ``gpus`` GPUs."""
    rng = random.Random(seed)
    order = list(nodes)
    rng.shuffle(order)
    chosen: list[Any] = []
    held = 0
    for node in order:
        if held >= gpus:
            break
        chosen.append(node)
        held += node.gpus
    return chosen


class Result(msgspec.Struct, frozen=True, kw_only=True):
    policy: str
    capacity: float
    seed: int
    gpus: int
    allocated_mean: float
    allocated_busy: float
    wait_p50: float
    wait_p99: float
    never_started: int
    fit_no_node: int
    """Pods that no node of the sample can hold even empty (CPU, memory, GPUs, gpu_spec)."""
    seconds: float


def fits_empty(node: Any, pod: Any) -> bool:
    """``pod`` fits ``node`` (a bench_openb.TraceNode) with nothing else on it."""
    if pod.gpu_spec and node.model not in pod.gpu_spec:
        return False
    return bool(
        node.cpu_milli >= pod.cpu_milli
        and node.memory_mib >= pod.memory_mib
        and node.gpus >= pod.num_gpu
    )


def refresh_least_used(node: Any) -> None:
    node.least_used = openb.Share(
        core=min(used.core for used in node.gpu_usage.values()),
        memory=min(used.memory for used in node.gpu_usage.values()),
    )


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def replay(policy_name: str, capacity: float, seed: int, traces: Path) -> Result:
    timed = read_timed(traces / POD_FILE)
    profile = demand_profile(timed)
    peak = max(present for _, present in profile)
    all_nodes = openb.read_nodes(traces / openb.NODE_FILE)
    nodes = sample_nodes(all_nodes, int(capacity * peak / openb.GPU_MILLI + 0.999), seed)
    cluster = openb.new_cluster(nodes)
    gpus_total = sum(n.gpus for n in nodes)
    rng = random.Random(seed)
    pods = [t.pod for t in timed]
    if policy_name == "gpupool":
        policy = openb.GpupoolPlacement()
    elif policy_name == "BestFit":
        policy = openb.best_fit_placement
    else:
        policy = openb.FgdPlacement(openb.trace_workload(pods), ties="random")
    start_clock = time.perf_counter()

    events: list[
        tuple[int, int, int, int]
    ] = []  # (time, order, kind, pod index); 0 leave, 1 arrive
    for index, t in enumerate(timed):
        heapq.heappush(events, (t.arrival, 1, index, 0))
    queues: dict[int, list[int]] = {}  # node -> pod indices waiting there, in order
    pending: list[int] = []  # not bound anywhere: the scheduler retries them
    where: dict[int, Any] = {}
    started_at: dict[int, int] = {}
    held_milli = 0
    area = busy_area = busy_time = 0.0
    last = timed[0].arrival
    trace_present = iter(profile)
    present_step = next(trace_present)
    demand_now = 0

    def start(index: int, outcome: Any, now: int) -> None:
        nonlocal held_milli
        started_at[index] = now
        held_milli += pods[index].gpu_demand_milli
        heapq.heappush(events, (now + timed[index].runs_for, 0, index, 0))

    def try_place(index: int, now: int) -> bool:
        pod = pods[index]
        outcome = policy(pod, cluster, rng)
        if isinstance(outcome, openb.Failed):
            return False
        openb.apply(cluster, pod, outcome)
        where[index] = outcome
        if isinstance(outcome, openb.Waiting):
            queues.setdefault(outcome.node, []).append(index)
        else:
            start(index, outcome, now)
        return True

    def serve_queue(node_index: int, now: int) -> None:
        """The node's ready queue in strict order (the admission-queue's schedule)."""
        queue = queues.get(node_index, [])
        node = cluster[node_index]
        while queue:
            index = queue[0]
            want = openb.share_of(pods[index])
            seen = Workload.of({Task(share=s): n for s, n in node.seen.items()})
            gpu = choose_gpu(node.gpu_usage, want, workload=seen)
            if gpu is None:
                break
            queue.pop(0)
            node.waiting -= 1
            node.gpu_usage[gpu] = add(node.gpu_usage[gpu], want)
            node.gpu_held += want.core
            refresh_least_used(node)
            node.version += 1
            node.verdicts.clear()
            outcome = openb.Placed(node=node_index, gpus=(gpu,))
            where[index] = outcome
            start(index, outcome, now)

    def leave(index: int) -> int:
        nonlocal held_milli
        pod = pods[index]
        outcome = where.pop(index)
        node = cluster[outcome.node]
        node.version += 1
        node.verdicts.clear()
        node.cpu_left += pod.cpu_milli
        node.memory_left += pod.memory_mib
        held_milli -= pod.gpu_demand_milli
        if pod.num_gpu:
            one = pod.num_gpu == 1
            share = openb.share_of(pod)
            node.share_requested = subtract(
                node.share_requested, share if one else openb.whole_gpus(pod)
            )
            if one:
                node.seen[share] -= 1
                if not node.seen[share]:
                    del node.seen[share]
            held = openb.asked_per_gpu(pod)
            for gpu in outcome.gpus:
                node.gpu_usage[gpu] = subtract(node.gpu_usage[gpu], held)
                node.gpu_held -= held.core
            refresh_least_used(node)
        return int(outcome.node)

    while events:
        now, kind, index, _ = heapq.heappop(events)
        while present_step[0] <= now:
            demand_now = present_step[1]
            present_step = next(trace_present, (1 << 62, 0))
        span = now - last
        area += held_milli * span
        if demand_now > gpus_total * openb.GPU_MILLI:
            busy_area += held_milli * span
            busy_time += span
        last = now
        if kind == 1:
            if not try_place(index, now):
                pending.append(index)
            continue
        node_index = leave(index)
        serve_queue(node_index, now)
        still: list[int] = []
        for waiting in pending:
            if not try_place(waiting, now):
                still.append(waiting)
        pending = still

    elapsed = last - timed[0].arrival
    capacity_milli = gpus_total * openb.GPU_MILLI
    waits = [started_at[i] - timed[i].arrival for i in started_at]
    return Result(
        policy=policy_name,
        capacity=capacity,
        seed=seed,
        gpus=gpus_total,
        allocated_mean=100 * area / (elapsed * capacity_milli),
        allocated_busy=100 * busy_area / (busy_time * capacity_milli) if busy_time else 0.0,
        wait_p50=percentile(waits, 0.5),
        wait_p99=percentile(waits, 0.99),
        never_started=len(timed) - len(started_at),
        fit_no_node=sum(1 for t in timed if not any(fits_empty(n, t.pod) for n in nodes)),
        seconds=time.perf_counter() - start_clock,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", type=Path, default=openb.DEFAULT_TRACES)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--capacity", default="0.5,0.75", help="cluster GPUs as fractions of the trace's peak"
    )
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    traces: Path = args.traces
    if not (traces / POD_FILE).is_file():
        print(f"bench_openb_departures: no openb traces in {traces}; skipped (see bench_openb).")
        return
    capacities = [float(c) for c in args.capacity.split(",")]
    seeds = range(openb.FIRST_SEED, openb.FIRST_SEED + args.seeds)
    jobs = [(p, c, s) for c in capacities for p in POLICIES for s in seeds]
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        futures = [pool.submit(replay, p, c, s, traces) for p, c, s in jobs]
        results = [f.result() for f in futures]
    print(
        f"openb default trace replayed by creation/deletion time; seeds "
        f"{seeds.start}..{seeds.stop - 1} (node samples); medians over the seeds"
    )
    header = (
        f"{'capacity':>9} {'GPUs':>5} {'policy':<20} {'alloc %':>8} {'alloc % busy':>13} "
        f"{'wait p50 s':>11} {'wait p99 s':>11} {'never started':>14} {'fit no node':>12}"
    )
    print(header)
    for capacity in capacities:
        for policy in POLICIES:
            rows = [r for r in results if r.policy == policy and r.capacity == capacity]
            med = statistics.median
            print(
                f"{capacity:>8.0%} {med(r.gpus for r in rows):5.0f} {policy:<20} "
                f"{med(r.allocated_mean for r in rows):8.2f} "
                f"{med(r.allocated_busy for r in rows):13.2f} "
                f"{med(r.wait_p50 for r in rows):11.0f} {med(r.wait_p99 for r in rows):11.0f} "
                f"{med(r.never_started for r in rows):14.0f} "
                f"{med(r.fit_no_node for r in rows):12.0f}"
            )
    busy = sum(r.seconds for r in results)
    print(
        f"\n{len(results)} replays, {busy:.0f} s summed, {time.perf_counter() - started:.0f} s wall"
    )


if __name__ == "__main__":
    main()
