"""gpupool's placement on the Alibaba 2023 openb GPU-sharing traces, against the published
results of the FGD paper's simulator (Weng et al., USENIX ATC'23) on the same traces.

    .venv/bin/python bench/bench_openb.py [--traces DIR] [--seeds 10] [--workers N]

DIR holds the files of alibaba/clusterdata ``cluster-trace-gpu-v2023/csv/`` plus the
simulator's published ``fgd_analysis_allo_discrete.csv`` (default
../shared/traces/openb beside the repository, or $GPUPOOL_OPENB_TRACES; see its README.md). Without them the
bench says so and exits 0.

Method (the published experiment's, as the README and the simulator's code describe it):
the 1,213 GPU nodes of ``openb_node_list_gpu_node.csv`` (6,212 GPUs) and the 8,152 pods of
``openb_pod_list_default.csv``. For each seed 42..51 the pods, sorted by name, are
shuffled, then pods drawn from the trace with replacement are appended until the arrived
GPU demand would pass 130 % of the cluster's GPUs. Pods arrive one by one and never leave;
a pod that fits nowhere fails and is not retried. After each arrival the allocated share
of the cluster's GPUs is recorded; the figure "at 100 % arrived" is the mean over the
arrivals whose arrived demand rounds to 100 % (the simulator's analysis does the same),
and the headline is the unallocated GPU percentage there, median of the seeds. Only the
arrivals up to 100.5 % are simulated: later ones cannot change that figure. Go's random
streams are not Python's: the seeds give other shuffles than the published runs, so
compare medians and ranges, not single seeds.

gpupool's placement, in its two stages, with its real functions:

* node: kube-scheduler keeps the nodes with CPU and memory left for the pod's requests;
  the extender (``gpupool.extender.rules``: ``classify``, ``why_not``, ``best_fit_score``)
  keeps the share-pool nodes whose share allocatable minus the requests bound there
  covers the pod's requests, and scores them 0..10 by best fit (how full the node's share
  resources will be); the highest score wins.
* GPU: the node's core (``gpupool.core.placement.choose_gpu``, ``fits``): best fit by
  limits among the GPUs the pod fits on.

Decisions the README does not give (the natural ones; the bench prints them too):

1. Shares: a ``num_gpu == 1`` pod asks gpu_milli/10 % of one GPU's compute and memory,
   as requests and as limits (the trace has no GPU-memory column and no limits).
2. Ties between the best-scored nodes go to a random one (kube-scheduler's selectHost
   does that). Only the extender's score ranks nodes: kube-scheduler's own score plugins
   (LeastAllocated, BalancedAllocation, ...) are not modelled.
3. A pod the extender sends to a node on which no GPU fits it (the node has room by
   requests, but not on any one GPU) is bound and waits in the node's ready queue; with
   no departures it waits for ever and counts as unallocated. The queue is served in
   strict order (gpupool's default; backfill is off): behind a waiting head, later
   GPU-sharing pods bound to that node wait too. Waiting pods hold their CPU, memory and
   share requests (they are bound).
4. ``num_gpu > 1`` pods ask whole GPUs: they go to nodes with that many empty GPUs, the
   node chosen by the extender's best-fit score with num_gpu × 100 % as the request, the
   GPUs by ``choose_gpu`` (the empty ones, lowest index first). They never queue.
5. ``num_gpu == 0`` pods use CPU and memory only: the extender has no preference, so a
   random node with room.
6. The CPU and memory gpupool's node controller reserves on an enabled node
   (``NodeStatusSettings``: 32 CPUs, 160Gi, sized for 16-GPU HPN nodes) are not
   reserved here: 159 of these 1,213 nodes have no more than that. Nodes keep their
   trace capacity; the GPU model is ignored (the default trace asks for none).

Baselines measured in the same run, by this file's own code, to show that the method
reproduces the published one: the simulator's Random (a random node among those the pod
fits on: CPU, memory and a GPU, or num_gpu empty GPUs; then a random GPU it fits on) and
its BestFit (the node with the least CPU and GPU left afterwards, 0.5 × CPU left / 128
CPUs + 0.5 × GPU left / 8 GPUs as an integer score 0..100, ties at random; then the
fullest GPU the pod fits on). Each is printed beside its published median, "reproduced"
within one point; otherwise the method differs and the bench says so. gpupool's median is
also shown as a multiple of the published BestFit and FGD medians (lower is better).

Prints tables; no assertions (the numbers depend on the seeds, not on the machine). Runs
the seeds on all cores (about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import msgspec

from gpupool.core.placement import GpuUsage, add, choose_gpu, fits
from gpupool.core.state import GPU_PERCENT
from gpupool.core.validation import (
    CORE_RESOURCE,
    EXCLUSIVE_GPU_RESOURCE,
    MEMORY_RESOURCE,
    POLICY_LABEL,
)
from gpupool.events import Share
from gpupool.extender.rules import GpuSharePod, best_fit_score, classify, why_not
from gpupool.kube.node_status import (
    NodeStatusSettings,
    OriginalResources,
    SharingEnabled,
    status_patch,
)
from gpupool.kube.records import Node, NodeStatus, ObjectMeta, Pod

DEFAULT_TRACES = Path(
    os.environ.get(
        "GPUPOOL_OPENB_TRACES",
        # shared/ lies beside the repository (in a developer's tree and in CI alike)
        Path(__file__).resolve().parents[2] / "shared" / "traces" / "openb",
    )
)
NODE_FILE = "openb_node_list_gpu_node.csv"
POD_FILE = "openb_pod_list_default.csv"
PUBLISHED_FILE = "fgd_analysis_allo_discrete.csv"
WORKLOAD = "openb_pod_list_default"
FIRST_SEED = 42
TUNE_RATIO = 1.3
"""Arrivals continue until the arrived GPU demand would pass 130 % of the cluster's GPUs."""
HEADLINE_ARRIVED = 100
"""The headline is read where the arrived GPU demand rounds to this percentage."""
GPU_MILLI = 1000
"""The trace's unit: 1000 = one whole GPU."""
WHOLE_GPU = Share(core=GPU_PERCENT, memory=GPU_PERCENT)
NO_SHARE = Share(core=0, memory=0)
PUBLISHED_POLICIES = ("Random", "DotProd", "GpuClustering", "GpuPacking", "BestFit", "FGD")
DECISIONS = (
    "shares: a 1-GPU pod asks gpu_milli/10 % of one GPU's core and memory, as requests and limits",
    "ties between the best-scored nodes go to a random one; kube-scheduler's own scores are not modelled",
    "a pod the extender binds where no GPU fits waits in the node's queue for ever (no departures); "
    "strict order: later sharing pods on that node wait behind it",
    "num_gpu > 1: whole empty GPUs (choose_gpu), node by the extender's best-fit score, never queued",
    "num_gpu == 0: CPU and memory only, a random node with room (the extender has no preference)",
    "no CPU/memory reserved for gpupool on enabled nodes (NodeStatusSettings sizes it for HPN nodes)",
)


# --------------------------------------------------------------------------- the traces


class TraceNode(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int


class TracePod(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    """Share of one GPU for a 1-GPU pod (1000 = whole); 1000 for multi-GPU pods."""

    @property
    def gpu_demand_milli(self) -> int:
        return self.num_gpu * self.gpu_milli


def read_nodes(path: Path) -> list[TraceNode]:
    with path.open(newline="") as file:
        return [
            TraceNode(
                name=row["sn"],
                cpu_milli=int(row["cpu_milli"]),
                memory_mib=int(row["memory_mib"]),
                gpus=int(row["gpu"]),
            )
            for row in csv.DictReader(file)
        ]


def read_pods(path: Path) -> list[TracePod]:
    with path.open(newline="") as file:
        return [
            TracePod(
                name=row["name"],
                cpu_milli=int(row["cpu_milli"]),
                memory_mib=int(row["memory_mib"]),
                num_gpu=int(row["num_gpu"]),
                gpu_milli=int(row["gpu_milli"]),
            )
            for row in csv.DictReader(file)
        ]


def read_published(path: Path, workload: str = WORKLOAD) -> dict[str, list[float]]:
    """Unallocated GPU % at ``HEADLINE_ARRIVED`` % arrived, per published policy, one per seed."""
    published: dict[str, list[float]] = {}
    with path.open(newline="") as file:
        for row in csv.DictReader(file):
            if row["workload"] != workload:
                continue
            policy = row["sc_policy"].split("-", 1)[1]  # "05-BestFit" -> "BestFit"
            allocated = float(row[str(HEADLINE_ARRIVED)])
            published.setdefault(policy, []).append(100 - allocated)
    return published


def arrivals(
    pods: Sequence[TracePod], capacity_milli: int, seed: int, ratio: float = TUNE_RATIO
) -> list[TracePod]:
    """The trace shuffled by ``seed``, then draws with replacement up to ``ratio`` × capacity."""
    rng = random.Random(seed)
    by_name = sorted(pods, key=lambda pod: pod.name)
    order = list(by_name)
    rng.shuffle(order)
    demand = sum(pod.gpu_demand_milli for pod in order)
    while True:
        extra = rng.choice(by_name)
        if demand + extra.gpu_demand_milli > ratio * capacity_milli:
            return order
        order.append(extra)
        demand += extra.gpu_demand_milli


# --------------------------------------------------------------------------- the cluster


class NodeState(msgspec.Struct, kw_only=True):
    """One node during a run (mutable)."""

    name: str
    gpus: int
    cpu_left: int
    memory_left: int
    gpu_usage: GpuUsage
    """Limits of the pods running on each GPU (a whole-GPU pod holds 100/100)."""
    share_requested: Share
    """Requests of the GPU pods bound here, running or waiting: the extender's usage."""
    gpu_held: int = 0
    """Sum of the compute % held on all GPUs (the simulator's allocated GPU milli / 10)."""
    least_used: Share = NO_SHARE
    """The least core and the least memory used on any one GPU (perhaps not the same GPU):
    a pod fits on no GPU where it does not fit beside these (a quick test before ``fits``)."""
    waiting: int = 0
    """GPU-sharing pods bound here that no GPU took (the node's ready queue)."""
    kube: Node
    """The node as gpupool's node controller leaves it with share-pool enabled."""

    def some_gpu_fits(self, want: Share) -> bool:
        if not fits(self.least_used, want):
            return False
        return any(fits(used, want) for used in self.gpu_usage.values())

    def has_room(self, pod: TracePod) -> bool:
        """kube-scheduler's CPU and memory check."""
        return self.cpu_left >= pod.cpu_milli and self.memory_left >= pod.memory_mib

    def empty_gpus(self) -> int:
        return sum(1 for used in self.gpu_usage.values() if fits(used, WHOLE_GPU))


T0 = datetime(2023, 1, 1, tzinfo=UTC)
NO_RESERVATION = NodeStatusSettings(reserved_cpu="0", reserved_memory="0")


def share_pool_node(name: str, gpus: int) -> Node:
    """A node with share-pool enabled, as ``status_patch`` writes it (decision 6: nothing reserved)."""
    original = OriginalResources(
        capacity={EXCLUSIVE_GPU_RESOURCE: str(gpus)},
        allocatable={EXCLUSIVE_GPU_RESOURCE: str(gpus)},
    )
    patch = status_patch(
        original,
        SharingEnabled(policy="share-pool"),
        gpus=gpus,
        current=(),
        settings=NO_RESERVATION,
        now=T0,
    )
    return Node(
        metadata=ObjectMeta(name=name, labels={POLICY_LABEL: "share-pool"}),
        status=NodeStatus(
            capacity={k: v for k, v in patch.capacity.items() if v is not None},
            allocatable={k: v for k, v in patch.allocatable.items() if v is not None},
            conditions=patch.conditions,
        ),
    )


def new_cluster(nodes: Sequence[TraceNode]) -> list[NodeState]:
    kube_nodes: dict[int, Node] = {}
    cluster: list[NodeState] = []
    for node in nodes:
        kube = kube_nodes.setdefault(
            node.gpus, share_pool_node(f"openb-{node.gpus}-gpu", node.gpus)
        )
        cluster.append(
            NodeState(
                name=node.name,
                gpus=node.gpus,
                cpu_left=node.cpu_milli,
                memory_left=node.memory_mib,
                gpu_usage={index: NO_SHARE for index in range(node.gpus)},
                share_requested=NO_SHARE,
                kube=kube,
            )
        )
    return cluster


# --------------------------------------------------------------------------- outcomes


class Placed(msgspec.Struct, frozen=True, kw_only=True):
    """Running on ``node``, holding ``gpus`` (none for a CPU-only pod)."""

    node: int
    gpus: tuple[int, ...] = ()


class Waiting(msgspec.Struct, frozen=True, kw_only=True):
    """Bound to ``node``, in its ready queue: no GPU (gpupool only)."""

    node: int


class Failed(msgspec.Struct, frozen=True, kw_only=True):
    """Fits on no node: not retried."""


Outcome = Placed | Waiting | Failed
Policy = Callable[[TracePod, list[NodeState], random.Random], Outcome]


def share_of(pod: TracePod) -> Share:
    """Decision 1: gpu_milli/10 % of one GPU's compute and memory."""
    percent = pod.gpu_milli * GPU_PERCENT // GPU_MILLI
    return Share(core=percent, memory=percent)


def whole_gpus(pod: TracePod) -> Share:
    return Share(core=GPU_PERCENT * pod.num_gpu, memory=GPU_PERCENT * pod.num_gpu)


def best_fit_gpus(pod: TracePod, want: Share, node: NodeState) -> tuple[int, ...]:
    """The fullest GPU the pod fits on (``choose_gpu``); for num_gpu > 1, empty GPUs in index order."""
    usage = dict(node.gpu_usage)
    gpus: list[int] = []
    for _ in range(pod.num_gpu):
        gpu = choose_gpu(usage, want)
        assert gpu is not None  # the policy chose a node where the pod fits
        usage[gpu] = add(usage[gpu], want)
        gpus.append(gpu)
    return tuple(gpus)


def asked_per_gpu(pod: TracePod) -> Share:
    return share_of(pod) if pod.num_gpu == 1 else WHOLE_GPU


def apply(cluster: list[NodeState], pod: TracePod, outcome: Outcome) -> None:
    """Bind the pod: CPU and memory for any bound pod, shares and GPUs for GPU pods."""
    if isinstance(outcome, Failed):
        return
    node = cluster[outcome.node]
    node.cpu_left -= pod.cpu_milli
    node.memory_left -= pod.memory_mib
    if pod.num_gpu == 0:
        return
    one_gpu = pod.num_gpu == 1
    node.share_requested = add(node.share_requested, share_of(pod) if one_gpu else whole_gpus(pod))
    if isinstance(outcome, Waiting):
        node.waiting += 1
        return
    held = asked_per_gpu(pod)
    for index in outcome.gpus:
        node.gpu_usage[index] = add(node.gpu_usage[index], held)
        node.gpu_held += held.core
    node.least_used = Share(
        core=min(used.core for used in node.gpu_usage.values()),
        memory=min(used.memory for used in node.gpu_usage.values()),
    )


def cpu_only(pod: TracePod, cluster: list[NodeState], rng: random.Random) -> Outcome:
    """Decision 5: a random node with CPU and memory left."""
    roomy = [i for i, node in enumerate(cluster) if node.has_room(pod)]
    return Placed(node=rng.choice(roomy)) if roomy else Failed()


# --------------------------------------------------------------------------- gpupool


class GpupoolPlacement:
    """The extender chooses the node, the node's core chooses the GPU.

    The extender's verdict and score for a node depend only on the node's labels and
    conditions (the same on every node here), its share allocatable (its GPU count), the
    requests bound there and the pod's requests: they are computed by the extender's
    own functions once per such key and remembered.
    """

    def __init__(self) -> None:
        self._kinds: dict[Share, GpuSharePod] = {}
        self._scores: dict[tuple[int, Share, Share], int | None] = {}

    def __call__(self, pod: TracePod, cluster: list[NodeState], rng: random.Random) -> Outcome:
        if pod.num_gpu == 0:
            return cpu_only(pod, cluster, rng)
        if pod.num_gpu == 1:
            return self._share_pod(pod, cluster, rng)
        return self._whole_gpu_pod(pod, cluster, rng)

    def _share_pod(self, pod: TracePod, cluster: list[NodeState], rng: random.Random) -> Outcome:
        kind = self._kind(share_of(pod))
        best = self._best_nodes(pod, cluster, kind.spec.requests, lambda node: True)
        if not best:
            return Failed()
        index = rng.choice(best)
        node = cluster[index]
        if node.waiting:
            return Waiting(node=index)  # strict order: the head blocks those behind it
        gpu = choose_gpu(node.gpu_usage, kind.spec.limits)
        return Waiting(node=index) if gpu is None else Placed(node=index, gpus=(gpu,))

    def _whole_gpu_pod(
        self, pod: TracePod, cluster: list[NodeState], rng: random.Random
    ) -> Outcome:
        best = self._best_nodes(
            pod, cluster, whole_gpus(pod), lambda node: node.empty_gpus() >= pod.num_gpu
        )
        if not best:
            return Failed()
        index = rng.choice(best)
        return Placed(node=index, gpus=best_fit_gpus(pod, WHOLE_GPU, cluster[index]))

    def _best_nodes(
        self,
        pod: TracePod,
        cluster: list[NodeState],
        requests: Share,
        eligible: Callable[[NodeState], bool],
    ) -> list[int]:
        """The nodes with the highest extender score among those kube and the extender pass."""
        best: list[int] = []
        top = -1
        for index, node in enumerate(cluster):
            if not node.has_room(pod):
                continue
            score = self._score(node, requests)
            if score is None or score < top or not eligible(node):
                continue
            if score > top:
                top, best = score, []
            best.append(index)
        return best

    def _score(self, node: NodeState, requests: Share) -> int | None:
        """The extender's score for the node, None where its filter keeps the pod off.

        A whole-GPU request (over 100 %) is not a GPU-sharing pod for the extender: it is
        only scored (decision 4); its filter is the empty-GPU check.
        """
        key = (node.gpus, node.share_requested, requests)
        if key not in self._scores:
            used = node.share_requested
            verdict = (
                None
                if requests.core > GPU_PERCENT
                else why_not(self._kind(requests), node.kube, lambda name: used)
            )
            self._scores[key] = (
                best_fit_score(node.kube, used, requests) if verdict is None else None
            )
        return self._scores[key]

    def _kind(self, share: Share) -> GpuSharePod:
        """The extender's view of a share-pool pod asking ``share`` (requests = limits)."""
        if share not in self._kinds:
            kind = classify(share_pool_pod(share))
            assert isinstance(kind, GpuSharePod), kind
            self._kinds[share] = kind
        return self._kinds[share]


def share_pool_pod(share: Share) -> Pod:
    amounts = {CORE_RESOURCE: str(share.core), MEMORY_RESOURCE: str(share.memory)}
    return msgspec.convert(
        {
            "metadata": {
                "name": "openb-pod",
                "namespace": "openb",
                "labels": {"alibabacloud.com/compute-class": "gpu-hpn", POLICY_LABEL: "share-pool"},
            },
            "spec": {
                "containers": [
                    {"name": "main", "resources": {"requests": amounts, "limits": amounts}}
                ]
            },
        },
        Pod,
    )


# --------------------------------------------------------------------------- baselines


def fits_somewhere(pod: TracePod, want: Share, node: NodeState) -> bool:
    """The simulator's filter: CPU and memory, and a GPU the pod fits on (or num_gpu empty GPUs)."""
    if not node.has_room(pod):
        return False
    if pod.num_gpu == 0:
        return True
    if pod.num_gpu == 1:
        return node.some_gpu_fits(want)
    return node.empty_gpus() >= pod.num_gpu


RANDOM_DRAWS = 64


def random_feasible_node(
    pod: TracePod, want: Share, cluster: list[NodeState], rng: random.Random
) -> int | None:
    """A node drawn uniformly among those the pod fits on: draws until one fits (rejection
    sampling), then, after ``RANDOM_DRAWS`` misses, a choice among all that fit."""
    for _ in range(RANDOM_DRAWS):
        index = rng.randrange(len(cluster))
        if fits_somewhere(pod, want, cluster[index]):
            return index
    feasible = [i for i, node in enumerate(cluster) if fits_somewhere(pod, want, node)]
    return rng.choice(feasible) if feasible else None


def random_placement(pod: TracePod, cluster: list[NodeState], rng: random.Random) -> Outcome:
    """The simulator's Random: a random node the pod fits on, then a random GPU it fits on
    (num_gpu > 1: the empty GPUs in index order)."""
    want = asked_per_gpu(pod)
    index = random_feasible_node(pod, want, cluster, rng)
    if index is None:
        return Failed()
    if pod.num_gpu != 1:
        return Placed(node=index, gpus=best_fit_gpus(pod, want, cluster[index]))
    usage = cluster[index].gpu_usage
    return Placed(node=index, gpus=(rng.choice([g for g in usage if fits(usage[g], want)]),))


MAX_SPEC_CPU_MILLI = 128_000
MAX_SPEC_GPU_MILLI = 8_000
"""The simulator's normalisation constants for BestFit (``MaxSpecCpu``, ``MaxSpecGpu``)."""


def best_fit_placement(pod: TracePod, cluster: list[NodeState], rng: random.Random) -> Outcome:
    """The simulator's BestFit: among the nodes the pod fits on, the one with the least CPU and
    GPU left afterwards, 0.5 × CPU left / 128 CPUs + 0.5 × GPU left / 8 GPUs, as an integer
    score 0..100 (ties at random); then the fullest GPU it fits on (best fit)."""
    want = asked_per_gpu(pod)
    best: list[int] = []
    top = -1
    for index, node in enumerate(cluster):
        if not node.has_room(pod):
            continue
        gpu_left_milli = (node.gpus * GPU_PERCENT - node.gpu_held) * GPU_MILLI // GPU_PERCENT
        left = 0.5 * (node.cpu_left - pod.cpu_milli) / MAX_SPEC_CPU_MILLI
        left += 0.5 * (gpu_left_milli - pod.gpu_demand_milli) / MAX_SPEC_GPU_MILLI
        score = int((1 - left) * 100)
        if score < top or not fits_somewhere(pod, want, node):
            continue
        if score > top:
            top, best = score, []
        if score == top:
            best.append(index)
    if not best:
        return Failed()
    index = rng.choice(best)
    return Placed(node=index, gpus=best_fit_gpus(pod, want, cluster[index]))


# --------------------------------------------------------------------------- runs


class Run(msgspec.Struct, frozen=True, kw_only=True):
    capacity_milli: int
    outcomes: list[Outcome]
    arrived_percent: list[float]
    """After each arrival: arrived GPU demand, % of the cluster's GPUs."""
    allocated_percent: list[float]
    """After each arrival: GPU shares held by running pods, % of the cluster's GPUs."""

    def unallocated_at(self, arrived: int = HEADLINE_ARRIVED) -> float:
        """100 − the mean allocated % over the arrivals whose arrived % rounds to ``arrived``."""
        at = [
            allocated
            for done, allocated in zip(self.arrived_percent, self.allocated_percent, strict=True)
            if round(done) == arrived
        ]
        if not at:
            raise ValueError(
                f"no arrival rounds to {arrived} % (arrived up to {self.arrived_percent[-1]:.2f} %)"
            )
        return 100 - statistics.fmean(at)

    def count(self, kind: type[Placed] | type[Waiting] | type[Failed]) -> int:
        return sum(1 for outcome in self.outcomes if isinstance(outcome, kind))


def simulate(
    nodes: Sequence[TraceNode], pods: Iterable[TracePod], policy: Policy, rng: random.Random
) -> Run:
    """Pods arrive in order and never leave; each is placed by ``policy`` or fails."""
    cluster = new_cluster(nodes)
    capacity = sum(node.gpus for node in nodes) * GPU_MILLI
    arrived = allocated = 0
    outcomes: list[Outcome] = []
    arrived_percent: list[float] = []
    allocated_percent: list[float] = []
    for pod in pods:
        outcome = policy(pod, cluster, rng)
        apply(cluster, pod, outcome)
        arrived += pod.gpu_demand_milli
        if isinstance(outcome, Placed):
            allocated += pod.gpu_demand_milli
        outcomes.append(outcome)
        arrived_percent.append(100 * arrived / capacity)
        allocated_percent.append(100 * allocated / capacity)
    return Run(
        capacity_milli=capacity,
        outcomes=outcomes,
        arrived_percent=arrived_percent,
        allocated_percent=allocated_percent,
    )


def until_past(pods: Sequence[TracePod], capacity_milli: int, percent: float) -> list[TracePod]:
    """The arrivals up to and including the first that takes the demand past ``percent``."""
    demand = 0
    for count, pod in enumerate(pods, start=1):
        demand += pod.gpu_demand_milli
        if 100 * demand > percent * capacity_milli:
            return list(pods[:count])
    return list(pods)


RANDOM_HERE = "Random (this bench)"
BEST_FIT_HERE = "BestFit (this bench)"
GPUPOOL = "gpupool"
POLICIES: dict[str, Callable[[], Policy]] = {
    RANDOM_HERE: lambda: random_placement,
    BEST_FIT_HERE: lambda: best_fit_placement,
    GPUPOOL: GpupoolPlacement,
}
REPRODUCED_WITHIN = 1.0
"""A baseline whose median is within this many points of the published one reproduces it."""


class SeedResult(msgspec.Struct, frozen=True, kw_only=True):
    policy: str
    seed: int
    unallocated: float
    placed: int
    waiting: int
    failed: int
    seconds: float


def run_seed(policy: str, seed: int, traces: Path) -> SeedResult:
    nodes = read_nodes(traces / NODE_FILE)
    pods = read_pods(traces / POD_FILE)
    capacity = sum(node.gpus for node in nodes) * GPU_MILLI
    order = until_past(arrivals(pods, capacity, seed), capacity, HEADLINE_ARRIVED + 0.5)
    start = time.perf_counter()
    run = simulate(nodes, order, POLICIES[policy](), random.Random(seed))
    return SeedResult(
        policy=policy,
        seed=seed,
        unallocated=run.unallocated_at(HEADLINE_ARRIVED),
        placed=run.count(Placed),
        waiting=run.count(Waiting),
        failed=run.count(Failed),
        seconds=time.perf_counter() - start,
    )


# --------------------------------------------------------------------------- report


def summary(values: Sequence[float]) -> str:
    return f"{statistics.median(values):6.2f}   {min(values):6.2f} – {max(values):6.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", type=Path, default=DEFAULT_TRACES)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    traces: Path = args.traces
    if not (traces / POD_FILE).is_file():
        print(
            f"bench_openb: no openb traces in {traces} (alibaba/clusterdata "
            "cluster-trace-gpu-v2023/csv/ and the FGD simulator's analysis_allo_discrete.csv); "
            "skipped. Give --traces DIR or GPUPOOL_OPENB_TRACES."
        )
        return
    nodes = read_nodes(traces / NODE_FILE)
    pods = read_pods(traces / POD_FILE)
    published = read_published(traces / PUBLISHED_FILE)
    seeds = range(FIRST_SEED, FIRST_SEED + args.seeds)
    print(
        f"openb: {len(nodes)} GPU nodes, {sum(n.gpus for n in nodes)} GPUs, {len(pods)} pods "
        f"({POD_FILE}); seeds {seeds.start}..{seeds.stop - 1}; arrivals to {TUNE_RATIO:.0%}, "
        f"no departures; unallocated GPU % at {HEADLINE_ARRIVED} % arrived"
    )
    print("decisions the README leaves open:")
    for number, decision in enumerate(DECISIONS, start=1):
        print(f"  {number}. {decision}")

    start = time.perf_counter()
    jobs = [(policy, seed) for policy in POLICIES for seed in seeds]
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        futures = [pool.submit(run_seed, policy, seed, traces) for policy, seed in jobs]
        results = [future.result() for future in futures]
    wall = time.perf_counter() - start

    ours = {policy: [r for r in results if r.policy == policy] for policy in POLICIES}
    print()
    print(f"{'policy':<22} {'median':>6}   {'min – max':>15}   source")
    for policy in PUBLISHED_POLICIES:
        values = published[policy]
        print(f"{policy:<22} {summary(values)}   published, FGD simulator ({len(values)} seeds)")
    for policy, rows in ours.items():
        values = [r.unallocated for r in rows]
        print(f"{policy:<22} {summary(values)}   measured here ({len(values)} seeds)")

    def median_of(policy: str) -> float:
        return statistics.median(r.unallocated for r in ours[policy])

    print()
    gpupool = median_of(GPUPOOL)
    for reference in ("BestFit", "FGD"):
        figure = statistics.median(published[reference])
        label = f"gpupool / published {reference}"
        print(f"{label:<40} {gpupool / figure:5.2f}×  ({gpupool:.2f} / {figure:.2f})")
    for reference, ours_name in (("Random", RANDOM_HERE), ("BestFit", BEST_FIT_HERE)):
        here, figure = median_of(ours_name), statistics.median(published[reference])
        verdict = (
            "reproduced"
            if abs(here - figure) <= REPRODUCED_WITHIN
            else "DIFFERS from the published figure: the method differs"
        )
        label = f"{ours_name} / published {reference}"
        print(f"{label:<40} {here / figure:5.2f}×  ({here:.2f} / {figure:.2f}): {verdict}")
    print()
    print(
        f"pods arrived up to {HEADLINE_ARRIVED + 0.5} %, median of seeds "
        "(waiting: bound by gpupool's extender to a node where no GPU fits, decision 3):"
    )
    print(f"{'policy':<22} {'placed':>7} {'waiting':>8} {'failed':>7}")
    for policy, rows in ours.items():
        print(
            f"{policy:<22} {statistics.median(r.placed for r in rows):7.0f} "
            f"{statistics.median(r.waiting for r in rows):8.0f} "
            f"{statistics.median(r.failed for r in rows):7.0f}"
        )
    busy = sum(r.seconds for r in results)
    print(
        f"\n{len(results)} runs, {busy:.0f} s summed over {args.workers} workers, {wall:.0f} s wall"
    )


if __name__ == "__main__":
    main()
