"""gpupool's placement on the Alibaba 2023 openb GPU-sharing traces, against the published
results of the FGD paper's simulator (Weng et al., USENIX ATC'23) on the same traces.

    .venv/bin/python bench/bench_openb.py [--traces DIR] [--pods FILE ...] [--seeds 5]
        [--workers N] [--fgd]

(``--seeds 10`` is the published experiment's full run.)

DIR holds the files of alibaba/clusterdata ``cluster-trace-gpu-v2023/csv/`` plus the
simulator's published ``fgd_analysis_allo_discrete.csv`` (default
../shared/traces/openb beside the repository, or $GPUPOOL_OPENB_TRACES; see its README.md). Without them the
bench says so and exits 0.

Method (the published experiment's, as the README and the simulator's code describe it):
the 1,213 GPU nodes of ``openb_node_list_gpu_node.csv`` (6,212 GPUs) and the 8,152 pods of
``openb_pod_list_default.csv``. For each seed 42.. the pods, sorted by name, are
shuffled, then pods drawn from the trace with replacement are appended until the arrived
GPU demand would pass 130 % of the cluster's GPUs. Pods arrive one by one and never leave;
a pod that fits nowhere fails and is not retried. After each arrival the allocated share
of the cluster's GPUs is recorded; the figure "at 100 % arrived" is the mean over the
arrivals whose arrived demand rounds to 100 % (the simulator's analysis does the same),
and the headline is the unallocated GPU percentage there, median of the seeds. Only the
arrivals up to 100.5 % are simulated: later ones cannot change that figure. Go's random
streams are not Python's: the seeds give other shuffles than the published runs, so
compare medians and ranges, not single seeds.

gpupool's placement, in its two stages, with its real functions (docs/placement.md):

* node: kube-scheduler keeps the nodes with CPU and memory left for the pod's requests
  (and of a GPU model in its ``gpu_spec``); the extender (``gpupool.extender.rules``:
  ``classify``, ``why_not``) keeps the share-pool nodes whose share allocatable minus the
  requests bound there covers the pod's requests, and scores them by
  ``placement_cost`` (fits a GPU by limits now; fragmentation gradient over the workload
  the cluster has seen, CPU and memory included, plus the GPU the node's CPU and memory
  left would strand; GPU left) and ``scores_by_cost`` (0..10);
  the highest score wins, ties at random.
* GPU: the node's core (``gpupool.core.placement.choose_gpu`` with ``node_workload``):
  the lowest fragmentation gradient for the shares seen on the node, then best fit.

Decisions the README does not give are listed in ``DECISIONS`` and printed. ``--pods``
takes any pod list of the same format; the published rows for its workload (the file's
stem) are shown when the CSV has them. ``--fgd`` adds ``FgdPlacement``, an FGD built in
this harness from the paper (random ties).

Baselines measured in the same run, by this file's own code, to show that the method
reproduces the published one: the simulator's Random (a random node among those the pod
fits on: CPU, memory and a GPU, or num_gpu empty GPUs; then a random GPU it fits on) and
its BestFit (the node with the least CPU and GPU left afterwards, 0.5 × CPU left / 128
CPUs + 0.5 × GPU left / 8 GPUs as an integer score 0..100, ties at random; then the
fullest GPU the pod fits on). Each is printed beside its published median, "reproduced"
within one point; otherwise the method differs and the bench says so. gpupool's median is
also shown as a multiple of the published BestFit and FGD medians (lower is better).

Prints tables; no assertions (the numbers depend on the seeds, not on the machine). Runs
the seeds on all cores: the default (3 traces × 5 seeds × 3 policies) takes about 12 CPU
minutes, 6 minutes of wall time on 2 idle cores.
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

from gpupool.core.fragmentation import (
    NodeFree,
    Task,
    Workload,
    fragmentation,
    place,
)
from gpupool.core.placement import GpuUsage, add, choose_gpu, fits, subtract
from gpupool.core.state import GPU_PERCENT
from gpupool.core.validation import (
    CORE_RESOURCE,
    EXCLUSIVE_GPU_RESOURCE,
    MEMORY_RESOURCE,
    POLICY_LABEL,
)
from gpupool.events import Share
from gpupool.extender.rules import (
    Cost,
    GpuSharePod,
    NodeModel,
    classify,
    placement_cost,
    why_not,
)
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
    "the extender's 0..10 score ranks nodes (10 = cheapest by placement_cost); ties between "
    "the best-scored nodes go to a random one; kube-scheduler's own scores are not modelled",
    "a pod the extender binds where no GPU fits waits in the node's queue for ever (no departures); "
    "strict order: later sharing pods on that node wait behind it",
    "num_gpu > 1: whole empty GPUs (lowest index), node by the extender's score, never queued",
    "num_gpu == 0: scored by the extender too, as when the scheduler profile sends it every "
    "pod (the shipped profile's managedResources send only GPU pods)",
    "no CPU/memory reserved for gpupool on enabled nodes (NodeStatusSettings sizes it for HPN nodes)",
    "the extender's model of a node is the node as it is (its replay of the bound pods through "
    "choose_gpu gives the node's own placement when pods become ready in the order bound)",
    "gpu_spec (GPU models a pod may use) is a node selector: other models are filtered out",
)


# --------------------------------------------------------------------------- the traces


class TraceNode(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str = ""


class TracePod(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    """Share of one GPU for a 1-GPU pod (1000 = whole); 1000 for multi-GPU pods."""
    gpu_spec: frozenset[str] = frozenset()
    """GPU models the pod may run on (empty: any), the trace's ``gpu_spec`` split on ``|``."""

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
                model=row.get("model", ""),
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
                gpu_spec=frozenset(m for m in (row.get("gpu_spec") or "").split("|") if m),
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
    model: str
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
    seen: dict[Share, int] = {}
    """Shares of the GPU-sharing pods bound here (the node's own workload), by share."""
    version: int = 0
    """Bumped at every change: remembered scores of the node are stale after it."""
    verdicts: dict[int, bool] = {}
    """The extender's filter verdicts for the node as it is, by the pod's gpu_milli."""
    kube: Node
    """The node as gpupool's node controller leaves it with share-pool enabled."""

    def some_gpu_fits(self, want: Share) -> bool:
        if not fits(self.least_used, want):
            return False
        return any(fits(used, want) for used in self.gpu_usage.values())

    def has_room(self, pod: TracePod) -> bool:
        """kube-scheduler's checks: CPU and memory, and the GPU model (``gpu_spec``, a node selector)."""
        if pod.gpu_spec and self.model not in pod.gpu_spec:
            return False
        return self.cpu_left >= pod.cpu_milli and self.memory_left >= pod.memory_mib

    def empty_gpus(self) -> int:
        return sum(1 for used in self.gpu_usage.values() if fits(used, WHOLE_GPU))

    def extender_model(self) -> NodeModel:
        """The extender's model of the node (decision 7: the node as it is)."""
        return NodeModel(
            free=NodeFree(
                cpu_milli=self.cpu_left,
                memory_mib=self.memory_left,
                gpus=tuple(subtract(WHOLE_GPU, self.gpu_usage[i]) for i in sorted(self.gpu_usage)),
            ),
            usage=self.gpu_usage,
            waiting=self.waiting,
            seen=Workload.of({Task(share=share): n for share, n in self.seen.items()}),
        )


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
                model=node.model,
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
    node.version += 1
    node.verdicts.clear()
    node.cpu_left -= pod.cpu_milli
    node.memory_left -= pod.memory_mib
    if pod.num_gpu == 0:
        return
    one_gpu = pod.num_gpu == 1
    node.share_requested = add(node.share_requested, share_of(pod) if one_gpu else whole_gpus(pod))
    if one_gpu:
        node.seen[share_of(pod)] = node.seen.get(share_of(pod), 0) + 1
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


# --------------------------------------------------------------------------- gpupool


class GpupoolPlacement:
    """The extender chooses the node, the node's core chooses the GPU.

    Filter: the extender's ``why_not`` (share requests bound on the node against its
    share allocatable), after kube-scheduler's CPU and memory check. Its verdict depends
    only on the node's labels and conditions (the same on every node here), its share
    allocatable (its GPU count), the requests bound there and the pod's requests: it is
    computed once per such key and remembered.

    Score: the extender's ``placement_cost`` on its model of each node, with the
    workload the cluster has seen (every pod that arrived so far, refolded at 1, 2, 4,
    ... arrivals and then every ``REFRESH_EVERY``), turned into
    0..10 by ``scores_by_cost``; ties between the best-scored nodes at random. The
    extender's model of a node is the node itself here (decision 7).

    GPU: the node's ``choose_gpu`` with ``node_workload`` (the shares of the pods bound
    there, the pod included), as the admission-queue calls it.
    """

    REFRESH_EVERY = 1024

    def __init__(self) -> None:
        self._kinds: dict[Share, GpuSharePod] = {}
        self._verdicts: dict[tuple[int, Share, Share], bool] = {}
        self._seen: dict[Task, float] = {}
        self._arrived = 0
        self._next_refresh = 1
        self.workload = Workload()
        self._costs: dict[Task, dict[int, tuple[Cost, tuple[int, ...]]]] = {}
        """Per task, by the node's state id (``_state_id``): nodes alike share their costs."""
        self._before: dict[int, float] = {}
        self._state_ids: dict[tuple[object, ...], int] = {}
        self._node_state: dict[int, tuple[int, int]] = {}
        """Node index -> (version, state id)."""

    def __call__(self, pod: TracePod, cluster: list[NodeState], rng: random.Random) -> Outcome:
        task = task_of(pod)
        self._see(task)
        per_task = self._costs.setdefault(task, {})
        costs: dict[int, Cost] = {}
        cpu, memory, spec = pod.cpu_milli, pod.memory_mib, pod.gpu_spec
        for index, node in enumerate(cluster):
            if node.cpu_left < cpu or node.memory_left < memory or not self._passes(pod, node):
                continue
            if spec and node.model not in spec:
                continue
            found = per_task.get(self._state_id(index, node))
            costs[index] = (found or self._cost(index, node, task))[0]
        if not costs:
            return Failed()
        # The nodes ``scores_by_cost`` gives its top score are exactly those of the lowest
        # cost: found here without scoring the others, in node order (kube-scheduler's
        # random tie-break among them).
        low = min(costs.values())
        index = rng.choice([name for name, cost in costs.items() if cost == low])
        node = cluster[index]
        cost, gpus = self._cost(index, node, task)
        if cost[0] != 0:
            return Waiting(node=index)  # no GPU fits by limits, or the queue has a head
        if pod.num_gpu == 1:  # the node's own choice, its workload now including the pod
            seen = dict(node.seen)
            seen[task.per_gpu()] = seen.get(task.per_gpu(), 0) + 1
            workload = Workload.of({Task(share=share): n for share, n in seen.items()})
            gpu = choose_gpu(node.gpu_usage, task.share, workload=workload)
            assert gpu is not None
            gpus = (gpu,)
        return Placed(node=index, gpus=gpus)

    def _state_id(self, index: int, node: NodeState) -> int:
        """An id for what the extender's model of the node holds: equal ids, equal costs."""
        known = self._node_state.get(index)
        if known is not None and known[0] == node.version:
            return known[1]
        key = (
            node.cpu_left,
            node.memory_left,
            node.waiting,
            *(node.gpu_usage[i] for i in sorted(node.gpu_usage)),
            None,
            *sorted(node.seen.items(), key=lambda item: (item[0].core, item[0].memory)),
        )
        found = self._state_ids.setdefault(key, len(self._state_ids))
        self._node_state[index] = (node.version, found)
        return found

    def _see(self, task: Task) -> None:
        """The extender watches every pod: fold the arrivals into the cluster's workload."""
        self._seen[task] = self._seen.get(task, 0.0) + 1
        self._arrived += 1
        if self._arrived >= self._next_refresh:
            self.workload = Workload.of(self._seen)
            self._costs.clear()
            self._before.clear()
            self._next_refresh = min(2 * self._arrived, self._arrived + self.REFRESH_EVERY)

    def _passes(self, pod: TracePod, node: NodeState) -> bool:
        """The extender's filter (one GPU) or decision 4's (several GPUs)."""
        if pod.num_gpu > 1:
            return node.empty_gpus() >= pod.num_gpu
        if pod.num_gpu == 0:
            return True
        verdict = node.verdicts.get(pod.gpu_milli)
        if verdict is None:
            requests = share_of(pod)
            key = (node.gpus, node.share_requested, requests)
            verdict = self._verdicts.get(key)
            if verdict is None:
                used = node.share_requested
                verdict = why_not(self._kind(requests), node.kube, lambda name: used) is None
                self._verdicts[key] = verdict
            node.verdicts[pod.gpu_milli] = verdict
        return verdict

    def _cost(self, index: int, node: NodeState, task: Task) -> tuple[Cost, tuple[int, ...]]:
        per_task = self._costs.setdefault(task, {})
        key = self._state_id(index, node)
        found = per_task.get(key)
        if found is None:
            before = self._before.get(key)
            model = node.extender_model()
            if before is None:
                before = self._before[key] = fragmentation(model.free, self.workload)
            found = per_task[key] = placement_cost(model, task, self.workload, before=before)
        return found

    def _kind(self, share: Share) -> GpuSharePod:
        """The extender's view of a share-pool pod asking ``share`` (requests = limits)."""
        if share not in self._kinds:
            kind = classify(share_pool_pod(share))
            assert isinstance(kind, GpuSharePod), kind
            self._kinds[share] = kind
        return self._kinds[share]


def task_of(pod: TracePod) -> Task:
    return Task(
        cpu_milli=pod.cpu_milli,
        memory_mib=pod.memory_mib,
        gpus=pod.num_gpu,
        share=share_of(pod) if pod.num_gpu == 1 else (WHOLE_GPU if pod.num_gpu else NO_SHARE),
    )


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


class FgdPlacement:
    """An FGD reference built in this harness from the paper's definitions: among the nodes
    the pod fits on (the simulator's filter), the node and GPU whose placement raises the
    node's fragmentation least, for the workload of the whole trace (the paper's target
    workload, known in advance); CPU-only pods too. Ties: the smallest node name (the
    published simulator's vendored kube-scheduler) or at random (stock kube-scheduler)."""

    def __init__(self, workload: Workload, *, ties: str = "name") -> None:
        self.workload = workload
        self.ties = ties
        self._memo: dict[tuple[int, int, Task], tuple[float, tuple[int, ...]]] = {}
        self._before: dict[tuple[int, int], float] = {}

    def __call__(self, pod: TracePod, cluster: list[NodeState], rng: random.Random) -> Outcome:
        task = task_of(pod)
        want = asked_per_gpu(pod)
        best: list[int] = []
        low = 0.0
        for index, node in enumerate(cluster):
            if not fits_somewhere(pod, want, node):
                continue
            change = self._best(index, node, task)[0]
            if not best or change < low:
                low, best = change, [index]
            elif change == low:
                best.append(index)
        if not best:
            return Failed()
        if self.ties == "name":
            index = min(best, key=lambda i: cluster[i].name)
        else:
            index = rng.choice(best)
        return Placed(node=index, gpus=self._best(index, cluster[index], task)[1])

    def _best(self, index: int, node: NodeState, task: Task) -> tuple[float, tuple[int, ...]]:
        key = (index, node.version, task)
        found = self._memo.get(key)
        if found is None:
            free = node.extender_model().free
            before = self._before.get((index, node.version))
            if before is None:
                before = self._before[index, node.version] = fragmentation(free, self.workload)
            order = sorted(node.gpu_usage)
            if task.gpus == 1:
                options = [
                    (at,) for at, gpu in enumerate(order) if fits(node.gpu_usage[gpu], task.share)
                ]
            elif task.gpus > 1:
                empty = [at for at, gpu in enumerate(order) if fits(node.gpu_usage[gpu], WHOLE_GPU)]
                options = [tuple(empty[: task.gpus])]
            else:
                options = [()]
            seen: dict[tuple[Share, ...], tuple[float, tuple[int, ...]]] = {}
            for option in options:
                shape = tuple(free.gpus[at] for at in option)
                if shape not in seen:
                    after = fragmentation(place(free, task, option), self.workload)
                    seen[shape] = (round(after - before, 9), tuple(order[at] for at in option))
            found = self._memo[key] = min(seen.values())
        return found


def trace_workload(pods: Iterable[TracePod]) -> Workload:
    return Workload.of(task_of(pod) for pod in pods)


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


FGD_HERE = "FGD (this harness)"
"""The optional FGD reference (``--fgd``): ``FgdPlacement`` with the trace's workload."""


class SeedResult(msgspec.Struct, frozen=True, kw_only=True):
    pods_file: str
    policy: str
    seed: int
    unallocated: float
    placed: int
    waiting: int
    failed: int
    seconds: float


def make_policy(policy: str, pods: Sequence[TracePod]) -> Policy:
    if policy == FGD_HERE:
        return FgdPlacement(trace_workload(pods), ties="random")
    return POLICIES[policy]()


def run_seed(policy: str, seed: int, node_file: Path, pods_file: Path) -> SeedResult:
    nodes = read_nodes(node_file)
    pods = read_pods(pods_file)
    capacity = sum(node.gpus for node in nodes) * GPU_MILLI
    order = until_past(arrivals(pods, capacity, seed), capacity, HEADLINE_ARRIVED + 0.5)
    start = time.perf_counter()
    run = simulate(nodes, order, make_policy(policy, pods), random.Random(seed))
    return SeedResult(
        pods_file=pods_file.name,
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


DEFAULT_PODS = (
    "openb_pod_list_default.csv",
    "openb_pod_list_gpushare40.csv",
    "openb_pod_list_multigpu20.csv",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", type=Path, default=DEFAULT_TRACES)
    parser.add_argument(
        "--pods",
        type=Path,
        action="append",
        help="a pod list of the openb format (repeatable; a bare name is looked up in --traces; "
        f"default: {', '.join(DEFAULT_PODS)})",
    )
    parser.add_argument(
        "--seeds", type=int, default=5, help="seeds 42.. per trace (10: the published full run)"
    )
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--fgd", action="store_true", help="also run this harness's FGD reference (slow)"
    )
    args = parser.parse_args()
    traces: Path = args.traces
    pods_files = [
        path if path.is_file() else traces / path for path in (args.pods or map(Path, DEFAULT_PODS))
    ]
    missing = [path for path in [traces / NODE_FILE, *pods_files] if not path.is_file()]
    if missing:
        print(
            f"bench_openb: no openb traces ({', '.join(map(str, missing))} missing; alibaba/"
            "clusterdata cluster-trace-gpu-v2023/csv/ and the FGD simulator's "
            "analysis_allo_discrete.csv); skipped. Give --traces DIR or GPUPOOL_OPENB_TRACES."
        )
        return
    nodes = read_nodes(traces / NODE_FILE)
    seeds = range(FIRST_SEED, FIRST_SEED + args.seeds)
    policies = [*POLICIES, *([FGD_HERE] if args.fgd else [])]
    print(
        f"openb: {len(nodes)} GPU nodes, {sum(n.gpus for n in nodes)} GPUs; seeds "
        f"{seeds.start}..{seeds.stop - 1}; arrivals to {TUNE_RATIO:.0%}, no departures; "
        f"unallocated GPU % at {HEADLINE_ARRIVED} % arrived"
    )
    print("decisions the README leaves open:")
    for number, decision in enumerate(DECISIONS, start=1):
        print(f"  {number}. {decision}")

    start = time.perf_counter()
    jobs = [(policy, seed, path) for path in pods_files for policy in policies for seed in seeds]
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        futures = [
            pool.submit(run_seed, policy, seed, traces / NODE_FILE, path)
            for policy, seed, path in jobs
        ]
        results = [future.result() for future in futures]
    wall = time.perf_counter() - start

    ratios: list[tuple[str, float, float, float, float, float | None]] = []
    for path in pods_files:
        workload = path.stem
        published = read_published(traces / PUBLISHED_FILE, workload)
        pods = read_pods(path)
        ours = {
            policy: [r for r in results if r.policy == policy and r.pods_file == path.name]
            for policy in policies
        }
        print(f"\n== {path.name}: {len(pods)} pods ==")
        print(f"{'policy':<22} {'median':>6}   {'min – max':>15}   source")
        for policy in PUBLISHED_POLICIES:
            values = published.get(policy)
            if values:
                print(f"{policy:<22} {summary(values)}   published ({len(values)} seeds)")
        for policy, rows in ours.items():
            values = [r.unallocated for r in rows]
            print(f"{policy:<22} {summary(values)}   measured here ({len(values)} seeds)")

        def median_of(policy: str, rows: dict[str, list[SeedResult]] = ours) -> float:
            return statistics.median(r.unallocated for r in rows[policy])

        gpupool = median_of(GPUPOOL)
        if not published:
            print(f"(no published rows for {workload})")
        for reference in ("BestFit", "FGD"):
            if reference in published:
                figure = statistics.median(published[reference])
                label = f"gpupool / published {reference}"
                print(f"{label:<40} {gpupool / figure:5.2f}×  ({gpupool:.2f} / {figure:.2f})")
        for reference, ours_name in (("Random", RANDOM_HERE), ("BestFit", BEST_FIT_HERE)):
            if reference not in published:
                continue
            here, figure = median_of(ours_name), statistics.median(published[reference])
            verdict = (
                "reproduced"
                if abs(here - figure) <= REPRODUCED_WITHIN
                else "DIFFERS from the published figure: the method differs"
            )
            label = f"{ours_name} / published {reference}"
            print(f"{label:<40} {here / figure:5.2f}×  ({here:.2f} / {figure:.2f}): {verdict}")
        print(f"{'policy':<22} {'placed':>7} {'waiting':>8} {'failed':>7}   (median, to 100.5 %)")
        for policy, rows in ours.items():
            print(
                f"{policy:<22} {statistics.median(r.placed for r in rows):7.0f} "
                f"{statistics.median(r.waiting for r in rows):8.0f} "
                f"{statistics.median(r.failed for r in rows):7.0f}"
            )
        fgd = statistics.median(published["FGD"]) if "FGD" in published else None
        ratios.append(
            (
                workload,
                median_of(RANDOM_HERE),
                median_of(BEST_FIT_HERE),
                fgd or 0.0,
                gpupool,
                None if fgd is None else gpupool / fgd,
            )
        )
    print("\nsummary (median unallocated GPU % at 100 % arrived):")
    print(f"{'trace':<30} {'Random':>7} {'BestFit':>8} {'FGD pub.':>9} {'gpupool':>8} {'/ FGD':>7}")
    for workload, rnd, best, fgd_figure, ours_median, ratio in ratios:
        shown = "—" if ratio is None else f"{ratio:.2f}×"
        print(
            f"{workload:<30} {rnd:7.2f} {best:8.2f} {fgd_figure:9.2f} {ours_median:8.2f} {shown:>7}"
        )
    busy = sum(r.seconds for r in results)
    print(
        f"\n{len(results)} runs, {busy:.0f} s summed over {args.workers} workers, {wall:.0f} s wall"
    )


if __name__ == "__main__":
    main()
