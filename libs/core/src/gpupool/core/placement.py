"""The share-pool placement rule, the ready-queue order and positions (docs/behaviour.md).

Each rule lives here, in one named function:

* ``fits``: a pod may run on a GPU only if, for compute and memory alike, the sum
  of the limits of the pods running there plus its own is at most 100.
* ``queue_order_key``: higher priority first, then the time the pod became ready
  (FIFO; ``ready_order`` breaks ties deterministically).
* ``choose_gpu``: among the GPUs a pod fits by limits, the one whose use leaves the
  node's free capacity least fragmented for the workload the node has seen
  (``node_workload``; the measure is ``gpupool.core.fragmentation``), then the
  fullest one (best fit), then the lowest index. Without a workload: best fit.
  The extender's model of a node and the admission-queue both choose with it.
* ``reservation_gpu``: with backfill, the GPU the head will get: the one that
  needs the least to be freed for it (a GPU with a preemption under way for the
  head wins).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from gpupool.core.fragmentation import (
    Task,
    Workload,
    distinct_group_fragments,
    expected_fragment,
    expected_fragment_after,
)
from gpupool.core.state import GPU_PERCENT, NodeState, PodState, State
from gpupool.events import PodRef, Share

STATUS_DORMANT = 0
STATUS_READY = 1
STATUS_RUNNING = 2
"""``DCGM_FI_POOLING_STATUS`` values (docs/behaviour.md)."""

WAITING_MESSAGE = "You have been waiting for {seconds} seconds. Approximate position: {position}"


def waiting_message(seconds: int, position: int) -> str:
    """The exact text a waiting pod prints (docs/behaviour.md, byte for byte)."""
    return WAITING_MESSAGE.format(seconds=seconds, position=position)


def pooling_status(pod: PodState) -> int:
    return {"dormant": STATUS_DORMANT, "ready": STATUS_READY, "running": STATUS_RUNNING}[pod.phase]


def queue_order_key(pod: PodState) -> tuple[int, int]:
    return (-pod.priority, pod.ready_order)


def ready_queue(state: State, node: str) -> list[PodState]:
    """The node's ready queue, head first."""
    waiting = [pod for pod in state.pods_on(node) if pod.phase == "ready"]
    waiting.sort(key=queue_order_key)
    return waiting


def queue_positions(state: State, node: str) -> dict[PodRef, int]:
    """1-based positions of the waiting pods (1 = head)."""
    return {pod.ref: index for index, pod in enumerate(ready_queue(state, node), start=1)}


def pooling_position(positions: Mapping[PodRef, int], pod: PodRef) -> int:
    """``DCGM_FI_POOLING_POSITION``: the queue position, 0 for a pod that is not waiting."""
    return positions.get(pod, 0)


GpuUsage = dict[int, Share]
"""Sum of the limits of the pods holding a slot on each GPU index."""


def gpu_usage(node: NodeState, pods: Iterable[PodState]) -> GpuUsage:
    usage: GpuUsage = {gpu.index: Share(core=0, memory=0) for gpu in node.gpus}
    for pod in pods:
        if pod.phase == "running" and pod.gpu_index is not None and pod.policy == "share-pool":
            held = usage.get(pod.gpu_index, Share(core=0, memory=0))
            usage[pod.gpu_index] = add(held, pod.limits)
    return usage


def static_usage(node: NodeState, pods: Iterable[PodState]) -> GpuUsage:
    """Static pods are bound by their requests (docs/behaviour.md, static model)."""
    usage: GpuUsage = {gpu.index: Share(core=0, memory=0) for gpu in node.gpus}
    for pod in pods:
        if pod.policy == "static" and pod.gpu_index is not None:
            held = usage.get(pod.gpu_index, Share(core=0, memory=0))
            usage[pod.gpu_index] = add(held, pod.requests)
    return usage


def add(a: Share, b: Share) -> Share:
    return Share(core=a.core + b.core, memory=a.memory + b.memory)


def subtract(a: Share, b: Share) -> Share:
    return Share(core=a.core - b.core, memory=a.memory - b.memory)


def fits(used: Share, want: Share) -> bool:
    return used.core + want.core <= GPU_PERCENT and used.memory + want.memory <= GPU_PERCENT


UNBOUNDED = 1 << 62
"""CPU and memory of a node seen by one GPU choice: the choice cannot change them."""


def choose_gpu(
    usage: GpuUsage, want: Share, *, exclude: int | None = None, workload: Workload | None = None
) -> int | None:
    """The GPU a pod asking ``want`` (its limits) gets, None if it fits on none.

    Only GPUs it fits on by limits (``fits``) are candidates. With a ``workload``: the
    candidate with the lowest fragmentation gradient for it, then the fullest, then the
    lowest index. Without one: the fullest, then the lowest index (best fit).
    """
    order = sorted(usage)
    return choose_gpu_in_order(order, [usage[index] for index in order], want, exclude, workload)


def choose_gpu_in_order(
    order: Sequence[int],
    used: Sequence[Share],
    want: Share,
    exclude: int | None,
    workload: Workload | None,
) -> int | None:
    """``choose_gpu`` of the usage ``dict(zip(order, used))``, ``order`` sorted."""
    core_left = GPU_PERCENT - want.core  # fits(used, want), the two sums compared once
    memory_left = GPU_PERCENT - want.memory
    candidates = [
        (index, held)
        for index, held in zip(order, used, strict=True)
        if index != exclude and held.core <= core_left and held.memory <= memory_left
    ]
    if not candidates:
        return None
    if not workload:
        return min(candidates, key=lambda candidate: (-_fullness(candidate[1]), candidate[0]))[0]
    # The gradient of each candidate, as fragmentation(after) - fragmentation(before) of the
    # node seen with unbounded CPU and memory: the per-group fragments are integers, so the
    # node after is the node before with one GPU's terms moved, and the expected values are
    # the very floats fragmentation() computes (expected_fragment, expected_fragment_after).
    counts: dict[Share, int] = {}
    for held in used:
        counts[held] = counts.get(held, 0) + 1
    before = distinct_group_fragments(
        {(GPU_PERCENT - held.core, GPU_PERCENT - held.memory): n for held, n in counts.items()},
        workload,
    )
    before_value = expected_fragment(before, workload, UNBOUNDED, UNBOUNDED)
    gradients: dict[Share, float] = {}
    best: tuple[float, int, int] | None = None
    for index, held in candidates:  # min by (gradient, -fullness, index), spelt out
        gradient = gradients.get(held)
        if gradient is None:
            free = subtract(WHOLE_GPU, held)
            value = expected_fragment_after(before, workload, free, want, UNBOUNDED, UNBOUNDED)
            gradient = gradients[held] = round(value - before_value, 9)
        key = (gradient, -(held.core + held.memory), index)
        if best is None or key < best:
            best = key
    assert best is not None  # candidates is not empty
    return best[2]


def _fullness(used: Share) -> int:
    return used.core + used.memory


WHOLE_GPU = Share(core=GPU_PERCENT, memory=GPU_PERCENT)


def node_workload(pods: Iterable[PodState]) -> Workload:
    """The GPU shares (limits) of the share-pool pods registered on a node: what it has seen."""
    return Workload.of(Task(gpus=1, share=pod.limits) for pod in pods if pod.policy == "share-pool")


def reservation_gpu(usage: GpuUsage, head: PodState, pods: Iterable[PodState]) -> int | None:
    """The GPU held for the head while later pods backfill (docs/behaviour.md, backfill)."""
    pending = [
        pod.gpu_index
        for pod in pods
        if pod.evicted_by == head.ref and pod.gpu_index is not None and pod.phase == "running"
    ]
    if pending:
        return pending[0]
    best: tuple[int, int] | None = None
    for index in sorted(usage):
        used = usage[index]
        short = max(0, used.core + head.limits.core - GPU_PERCENT) + max(
            0, used.memory + head.limits.memory - GPU_PERCENT
        )
        if best is None or short < best[0]:
            best = (short, index)
    return None if best is None else best[1]


def allocated_requests(pods: Iterable[PodState]) -> Share:
    """Sum of the requests of the pods registered on a node (admission by requests)."""
    total = Share(core=0, memory=0)
    for pod in pods:
        total = add(total, pod.requests)
    return total
