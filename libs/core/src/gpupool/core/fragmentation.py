"""How fragmented a node's free GPU capacity is for the workload a cluster runs (docs/placement.md).

The measure follows the idea of Fragmentation Gradient Descent (Weng et al., USENIX
ATC'23), written here from the paper's definitions:

* A **task** is a kind of pod: CPU (milli), memory (MiB), a number of GPUs and, per
  GPU, a share of compute and memory (percent of one GPU; a pod on several GPUs takes
  them whole).
* For one task, the **fragment** of a node is the free GPU compute (percent) that the
  task cannot use there: all of it if the task does not fit on the node at all (not
  enough CPU, memory, or no GPU it fits on / not enough whole free GPUs); otherwise the
  free compute of the GPUs the task does not fit on (a 1-GPU task: a GPU whose free
  compute or memory is below the task's share; a multi-GPU task: a GPU not wholly free).
  A task that asks no GPU and fits leaves no fragment.
* The **fragmentation** of a node for a workload (a distribution of tasks, weighted by
  how often each was seen) is the expected fragment: the weighted mean over the tasks.
* The **gradient** of a placement is the change of the node's fragmentation when the
  pod is placed: ``fragmentation(after) - fragmentation(before)``. Lower is better: a
  placement that fills a GPU to where the remaining capacity still fits typical pods
  costs little; one that leaves an unusable sliver costs its size.
* Beyond FGD, the **stranded** GPU of a node (``stranded``): the free GPU compute that
  the node's free CPU (and, apart, its free memory) could not serve if the GPU pods to
  come asked CPU and memory per GPU as the workload's GPU pods do on average
  (``Workload.cpu_per_percent``, ``memory_per_percent``). FGD sees a node's CPU only
  once it is too short for one pod; this sees it running short for the rest of the
  node's GPUs. The extender adds its change to the gradient (docs/placement.md).

Pure: no clock, no randomness. Units are integers (percent of a GPU, CPU milli, memory
MiB) except the expected values, which are floats.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import msgspec

from gpupool.core.state import GPU_PERCENT
from gpupool.events import Share

WHOLE = Share(core=GPU_PERCENT, memory=GPU_PERCENT)
NOTHING = Share(core=0, memory=0)


class Task(msgspec.Struct, frozen=True, kw_only=True):
    """A kind of pod, as the measure sees it."""

    cpu_milli: int = 0
    memory_mib: int = 0
    gpus: int = 1
    """GPUs the pod holds: 0 (CPU only), 1 (a share of one GPU) or more (whole GPUs)."""
    share: Share = WHOLE
    """Per GPU: the share of compute and memory (WHOLE for pods on several GPUs)."""

    def per_gpu(self) -> Share:
        if self.gpus == 0:
            return NOTHING
        return self.share if self.gpus == 1 else WHOLE


class NodeFree(msgspec.Struct, frozen=True, kw_only=True):
    """What is left on a node: CPU, memory, and each GPU's free compute and memory."""

    cpu_milli: int
    memory_mib: int
    gpus: tuple[Share, ...]

    @property
    def free_compute(self) -> int:
        return sum(gpu.core for gpu in self.gpus)


class DemandGroup(msgspec.Struct, frozen=True):
    """The tasks with one GPU demand (gpus, core, memory): their (cpu, memory, probability)."""

    gpus: int
    core: int
    memory: int
    rows: tuple[tuple[int, int, float], ...]
    weight: float
    """Probability of the group: the sum of its rows'."""
    most_cpu: int
    most_memory: int
    """The most CPU and memory any task of the group asks: a node with that fits them all."""


class Workload(msgspec.Struct, frozen=True, kw_only=True):
    """A distribution of tasks: each task with its weight (how often it was seen).

    Build it with ``Workload.of``; ``groups`` is derived from ``weights`` there.
    """

    weights: tuple[tuple[Task, float], ...] = ()
    groups: tuple[DemandGroup, ...] = ()
    cpu_per_percent: float = 0.0
    """The GPU tasks' CPU (milli) per percent of a GPU they hold, weighted (0: no GPU task)."""
    memory_per_percent: float = 0.0
    """The same for memory (MiB per percent of a GPU)."""

    @classmethod
    def of(cls, tasks: Iterable[Task] | Mapping[Task, float]) -> Workload:
        """The distribution of the tasks given (a mapping: task -> weight; or one per pod)."""
        counts: dict[Task, float] = {}
        if isinstance(tasks, Mapping):
            for task, weight in tasks.items():
                if weight > 0:
                    counts[task] = counts.get(task, 0.0) + float(weight)
        else:
            for task in tasks:
                counts[task] = counts.get(task, 0.0) + 1.0
        ordered = sorted(counts.items(), key=lambda item: _task_order(item[0]))
        total = sum(weight for _, weight in ordered)
        by_demand: dict[tuple[int, int, int], list[tuple[int, int, float]]] = {}
        for task, weight in ordered:
            want = task.per_gpu()
            key = (task.gpus, want.core, want.memory)
            by_demand.setdefault(key, []).append((task.cpu_milli, task.memory_mib, weight / total))
        groups = tuple(
            DemandGroup(
                gpus,
                core,
                memory,
                tuple(rows),
                sum(w for _, _, w in rows),
                max(c for c, _, _ in rows),
                max(m for _, m, _ in rows),
            )
            for (gpus, core, memory), rows in by_demand.items()
        )
        held = sum(weight * task.gpus * task.per_gpu().core for task, weight in ordered)
        cpu = sum(weight * task.cpu_milli for task, weight in ordered if task.gpus)
        memory = sum(weight * task.memory_mib for task, weight in ordered if task.gpus)
        return cls(
            weights=tuple(ordered),
            groups=groups,
            cpu_per_percent=cpu / held if held else 0.0,
            memory_per_percent=memory / held if held else 0.0,
        )

    @classmethod
    def of_shares(cls, shares: Iterable[tuple[Share, int]]) -> Workload:
        """``Workload.of({Task(gpus=1, share=share): count, ...})`` for distinct shares (a
        node's ``NodeState.shares``), built without the general grouping: one group per
        share. Equal to it field for field: the same floats, summed by ``sum`` in the same
        order."""
        ordered = sorted(
            ((Task(gpus=1, share=share), float(count)) for share, count in shares if count > 0),
            key=lambda item: (item[0].share.core, item[0].share.memory),
        )
        total = sum(weight for _, weight in ordered)
        groups = []
        for task, weight in ordered:
            share = weight / total
            groups.append(
                DemandGroup(1, task.share.core, task.share.memory, ((0, 0, share),), share, 0, 0)
            )
        held = sum(weight * task.share.core for task, weight in ordered)
        idle = sum(weight * 0 for _, weight in ordered)  # the tasks' CPU and memory: none
        return cls(
            weights=tuple(ordered),
            groups=tuple(groups),
            cpu_per_percent=idle / held if held else 0.0,
            memory_per_percent=idle / held if held else 0.0,
        )

    @property
    def total(self) -> float:
        return sum(weight for _, weight in self.weights)

    def __bool__(self) -> bool:
        return bool(self.weights)

    def gpu_only(self) -> Workload:
        """The same distribution with CPU and memory dropped (what one GPU choice can see)."""
        counts: dict[Task, float] = {}
        for task, weight in self.weights:
            key = Task(gpus=task.gpus, share=task.per_gpu())
            counts[key] = counts.get(key, 0.0) + weight
        return Workload.of(counts)


def _task_order(task: Task) -> tuple[int, int, int, int, int]:
    return (task.gpus, task.share.core, task.share.memory, task.cpu_milli, task.memory_mib)


def _gpu_fits(free: Share, want: Share) -> bool:
    return want.core <= free.core and want.memory <= free.memory


def task_fragment(node: NodeFree, task: Task) -> int:
    """The free GPU compute (percent) of ``node`` that ``task`` cannot use."""
    total = node.free_compute
    if task.cpu_milli > node.cpu_milli or task.memory_mib > node.memory_mib:
        return total
    return _gpu_fragment(node.gpus, total, task.gpus, task.per_gpu())


def _gpu_fragment(gpus: Sequence[Share], total: int, count: int, want: Share) -> int:
    if count == 0:
        return 0
    if count == 1:
        return sum(gpu.core for gpu in gpus if not _gpu_fits(gpu, want))
    whole = sum(1 for gpu in gpus if gpu.core >= GPU_PERCENT and gpu.memory >= GPU_PERCENT)
    if whole < count:
        return total
    return total - whole * GPU_PERCENT


def fragmentation(node: NodeFree, workload: Workload) -> float:
    """The expected fragment of ``node`` over ``workload`` (percent of a GPU; 0 if no workload)."""
    total = node.free_compute
    if total == 0 or not workload:
        return 0.0
    distinct: dict[tuple[int, int], int] = {}
    for gpu in node.gpus:
        key = (gpu.core, gpu.memory)
        distinct[key] = distinct.get(key, 0) + 1
    whole = distinct.get((GPU_PERCENT, GPU_PERCENT), 0)
    cpu, memory = node.cpu_milli, node.memory_mib
    expected = 0.0
    for group in workload.groups:
        if group.gpus == 0:
            fragment = 0
        elif group.gpus == 1:
            fragment = sum(
                core * count
                for (core, mem), count in distinct.items()
                if core < group.core or mem < group.memory
            )
        else:
            fragment = total if whole < group.gpus else total - whole * GPU_PERCENT
        if fragment == total:
            expected += total * group.weight
        elif group.most_cpu <= cpu and group.most_memory <= memory:
            expected += fragment * group.weight
        else:
            for task_cpu, task_memory, weight in group.rows:
                expected += weight * (total if task_cpu > cpu or task_memory > memory else fragment)
    return expected


class GroupFragments(msgspec.Struct, frozen=True):
    """A node's GPUs as ``fragmentation`` weighs them, with CPU and memory left aside: the
    free compute, how many GPUs are wholly free, and per group of the workload (in order)
    the fragment. All integers: exact, whatever the order of summing."""

    total: int
    whole: int
    fragments: tuple[int, ...]


def group_fragments(gpus: Iterable[Share], workload: Workload) -> GroupFragments:
    """``GroupFragments`` of GPUs whose free shares are ``gpus``."""
    distinct: dict[tuple[int, int], int] = {}
    for gpu in gpus:
        key = (gpu.core, gpu.memory)
        distinct[key] = distinct.get(key, 0) + 1
    return distinct_group_fragments(distinct, workload)


def distinct_group_fragments(
    distinct: Mapping[tuple[int, int], int], workload: Workload
) -> GroupFragments:
    """``GroupFragments`` of GPUs given as how many have each free (compute, memory)."""
    total = 0
    for (core, _), count in distinct.items():
        total += core * count
    whole = distinct.get((GPU_PERCENT, GPU_PERCENT), 0)
    fragments: list[int] = []
    for group in workload.groups:
        if group.gpus == 0:
            fragments.append(0)
        elif group.gpus == 1:
            least_core, least_memory = group.core, group.memory
            fragment = 0
            for (core, memory), count in distinct.items():
                if core < least_core or memory < least_memory:
                    fragment += core * count
            fragments.append(fragment)
        else:
            fragments.append(total if whole < group.gpus else total - whole * GPU_PERCENT)
    return GroupFragments(total, whole, tuple(fragments))


def expected_fragment_after(
    parts: GroupFragments,
    workload: Workload,
    free: Share,
    want: Share,
    cpu_milli: int,
    memory_mib: int,
) -> float:
    """``expected_fragment`` of the node ``parts`` once one GPU whose free share is ``free``
    gives ``want`` to a pod (the node's CPU and memory then ``cpu_milli``, ``memory_mib``):
    only that GPU's terms of each fragment change, so O(groups) instead of O(groups x GPUs),
    and the float is ``fragmentation``'s of the node after, bit for bit."""
    left_core = free.core - want.core
    left_memory = free.memory - want.memory
    total = parts.total - want.core
    if total == 0 or not workload:
        return 0.0
    whole = (
        parts.whole
        - (free.core == GPU_PERCENT and free.memory == GPU_PERCENT)
        + (left_core == GPU_PERCENT and left_memory == GPU_PERCENT)
    )
    expected = 0.0
    for group, fragment in zip(workload.groups, parts.fragments, strict=True):
        gpus = group.gpus
        if gpus == 1:
            core, memory = group.core, group.memory
            if free.core < core or free.memory < memory:
                fragment -= free.core
            if left_core < core or left_memory < memory:
                fragment += left_core
        elif gpus == 0:
            fragment = 0
        else:
            fragment = total if whole < gpus else total - whole * GPU_PERCENT
        # the sum of expected_fragment, term for term
        if fragment == total:
            expected += total * group.weight
        elif group.most_cpu <= cpu_milli and group.most_memory <= memory_mib:
            expected += fragment * group.weight
        else:
            for task_cpu, task_memory, weight in group.rows:
                expected += weight * (
                    total if task_cpu > cpu_milli or task_memory > memory_mib else fragment
                )
    return expected


def expected_fragment(
    parts: GroupFragments, workload: Workload, cpu_milli: int, memory_mib: int
) -> float:
    """``fragmentation`` of a node whose GPUs are ``parts``, with its CPU and memory: the same
    float, bit for bit (the same products of the same integers, added in the same order)."""
    total = parts.total
    if total == 0 or not workload:
        return 0.0
    expected = 0.0
    for group, fragment in zip(workload.groups, parts.fragments, strict=True):
        if fragment == total:
            expected += total * group.weight
        elif group.most_cpu <= cpu_milli and group.most_memory <= memory_mib:
            expected += fragment * group.weight
        else:
            for task_cpu, task_memory, weight in group.rows:
                expected += weight * (
                    total if task_cpu > cpu_milli or task_memory > memory_mib else fragment
                )
    return expected


def stranded(node: NodeFree, workload: Workload) -> float:
    """The free GPU compute (percent) of ``node`` that its free CPU, and apart its free memory,
    could not serve at the workload's CPU and memory per percent of GPU: for each, the free
    compute less what the resource left would carry, if positive; the two are added.

    0 for a workload without GPU tasks, or one whose GPU tasks ask none of the resource.
    """
    cpu_rate, memory_rate = workload.cpu_per_percent, workload.memory_per_percent
    if cpu_rate <= 0 and memory_rate <= 0:
        return 0.0
    total = node.free_compute
    amount = 0.0
    if cpu_rate > 0 and total * cpu_rate > node.cpu_milli:
        amount += total - node.cpu_milli / cpu_rate
    if memory_rate > 0 and total * memory_rate > node.memory_mib:
        amount += total - node.memory_mib / memory_rate
    return amount


def place(node: NodeFree, task: Task, gpus: Iterable[int]) -> NodeFree:
    """The node once ``task`` holds ``gpus`` (its per-GPU share on each) and its CPU and memory."""
    want = task.per_gpu()
    left = list(node.gpus)
    for index in gpus:
        held = left[index]
        left[index] = Share(core=held.core - want.core, memory=held.memory - want.memory)
    return NodeFree(
        cpu_milli=node.cpu_milli - task.cpu_milli,
        memory_mib=node.memory_mib - task.memory_mib,
        gpus=tuple(left),
    )


def gradient(node: NodeFree, task: Task, gpus: Iterable[int], workload: Workload) -> float:
    """How much placing ``task`` on ``gpus`` of ``node`` changes the node's fragmentation."""
    return fragmentation(place(node, task, gpus), workload) - fragmentation(node, workload)
