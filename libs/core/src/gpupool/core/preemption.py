"""Preemption planning (docs/behaviour.md, victim selection), on a snapshot, pure.

Preemption is considered only when the node has ``preemptEnabled`` and the head of
the ready queue fits on no GPU. Victims are chosen on one GPU: the smallest set
whose removal lets the head fit, among running pods that either

* (a) have strictly lower priority than the head (reason ``priority``), or
* (b) have held their GPU continuously for at least ``podMaxDurationMinutes``
  and do not have higher priority than the head (reason ``max-duration``).

Among sets of the same size, lower priority is preferred, then the longest
continuous hold; then the lowest GPU index. A pod is never preempted for a pod
of lower priority; static pods are never preempted. While a preemption is under
way on a node (a victim has not released yet) no other is planned there.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from datetime import datetime, timedelta

from gpupool.core.placement import GpuUsage, fits, subtract
from gpupool.core.state import NodeState, PodState, State
from gpupool.events import PodRef, PreemptReason, Share

MAX_SUBSETS_CHECKED = 20_000
"""Above this many candidate sets on one GPU, the search falls back to the preference order."""


@dataclass(frozen=True, slots=True)
class Victim:
    pod: PodState
    reason: PreemptReason


@dataclass(frozen=True, slots=True)
class PreemptionPlan:
    head: PodState
    gpu_index: int
    gpu_uuid: str
    victims: tuple[Victim, ...]


def eligibility(
    candidate: PodState, head: PodState, node: NodeState, now: datetime
) -> PreemptReason | None:
    """Why ``candidate`` may be preempted for ``head``, or None if it may not."""
    if candidate.policy != "share-pool" or candidate.phase != "running":
        return None
    if candidate.evicted_by is not None or candidate.running_since is None:
        return None
    if candidate.priority < head.priority:
        return "priority"
    minutes = node.qos.pod_max_duration_minutes
    if (
        minutes is not None
        and candidate.priority <= head.priority
        and now - candidate.running_since >= timedelta(minutes=minutes)
    ):
        return "max-duration"
    return None


def _preference(pod: PodState) -> tuple[int, datetime, str, str]:
    assert pod.running_since is not None
    return (pod.priority, pod.running_since, pod.ref.namespace, pod.ref.name)


def _smallest_set(
    used: Share, want: Share, candidates: list[PodState]
) -> tuple[PodState, ...] | None:
    checked = 0
    for size in range(1, len(candidates) + 1):
        for subset in itertools.combinations(candidates, size):
            checked += 1
            freed = used
            for pod in subset:
                freed = subtract(freed, pod.limits)
            if fits(freed, want):
                return subset
            if checked >= MAX_SUBSETS_CHECKED:
                return _greedy_set(used, want, candidates)
    return None


def _greedy_set(
    used: Share, want: Share, candidates: list[PodState]
) -> tuple[PodState, ...] | None:
    chosen: list[PodState] = []
    for pod in candidates:
        chosen.append(pod)
        used = subtract(used, pod.limits)
        if fits(used, want):
            return tuple(chosen)
    return None


def plan_preemption(
    state: State, node_name: str, usage: GpuUsage, now: datetime
) -> PreemptionPlan | None:
    node = state.nodes.get(node_name)
    if node is None or node.policy != "share-pool" or not node.qos.preempt_enabled:
        return None
    if not node.queue:  # the ready queue evolve keeps: nobody waits, nothing to plan
        return None
    head = state.pods[node.queue[0][4]]
    if any(fits(used, head.limits) for used in usage.values()):
        return None
    pods = state.pods_on(node_name)
    if any(pod.evicted_by is not None for pod in pods):
        return None
    eligible: dict[int, list[PodState]] = {}
    reasons: dict[PodRef, PreemptReason] = {}
    for pod in pods:
        if pod.phase == "running" and pod.gpu_index is not None:
            reason = eligibility(pod, head, node, now)
            if reason is not None:
                reasons[pod.ref] = reason
                eligible.setdefault(pod.gpu_index, []).append(pod)
    best: tuple[tuple[object, ...], PreemptionPlan] | None = None
    for gpu in node.gpus:
        candidates = sorted(eligible.get(gpu.index, []), key=_preference)
        chosen = _smallest_set(usage[gpu.index], head.limits, candidates)
        if chosen is None:
            continue
        rank = (len(chosen), tuple(_preference(pod) for pod in chosen), gpu.index)
        plan = PreemptionPlan(
            head=head,
            gpu_index=gpu.index,
            gpu_uuid=gpu.uuid,
            victims=tuple(Victim(pod=pod, reason=reasons[pod.ref]) for pod in chosen),
        )
        if best is None or rank < best[0]:
            best = (rank, plan)
    return None if best is None else best[1]


class PreemptionDeadlines:
    """The nodes' next ``next_preemption_check`` times in a heap, updated per node touched.

    The preemption service updates only the nodes an event touched, then sleeps until
    the earliest deadline: the cost after an event does not grow with the node count.
    """

    def __init__(self) -> None:
        self._at: dict[str, datetime] = {}
        self._heap: list[tuple[datetime, str]] = []

    def update(self, state: State, node_name: str, now: datetime) -> None:
        when = next_preemption_check(state, node_name, now)
        if when is None:
            self._at.pop(node_name, None)
            return
        if self._at.get(node_name) != when:
            self._at[node_name] = when
            heapq.heappush(self._heap, (when, node_name))

    def may_change(self, state: State, node_name: str) -> bool:
        """Whether :meth:`update` could change anything for the node: it holds a deadline, or
        may get one (preemption on, a maximum duration set: see ``next_preemption_check``)."""
        if node_name in self._at:
            return True
        node = state.nodes.get(node_name)
        return (
            node is not None
            and node.qos.preempt_enabled
            and node.qos.pod_max_duration_minutes is not None
        )

    def earliest(self) -> tuple[datetime, str] | None:
        """The earliest deadline and its node (stale heap entries are dropped on the way)."""
        while self._heap:
            when, node_name = self._heap[0]
            if self._at.get(node_name) == when:
                return when, node_name
            heapq.heappop(self._heap)
        return None

    def passed(self, node_name: str) -> None:
        """The node's deadline was acted on: forget it until the node is updated again."""
        self._at.pop(node_name, None)


def next_preemption_check(state: State, node_name: str, now: datetime) -> datetime | None:
    """After ``now``, when a running pod next crosses ``podMaxDurationMinutes`` while pods wait.

    The caller owns the timer; at that time it asks ``decide`` for a PlanPreemption.
    """
    node = state.nodes.get(node_name)
    if node is None or not node.qos.preempt_enabled or node.qos.pod_max_duration_minutes is None:
        return None
    pods = state.pods_on(node_name)
    if not any(pod.phase == "ready" for pod in pods):
        return None
    limit = timedelta(minutes=node.qos.pod_max_duration_minutes)
    times = [
        pod.running_since + limit
        for pod in pods
        if pod.phase == "running"
        and pod.running_since is not None
        and pod.policy == "share-pool"
        and pod.running_since + limit > now
    ]
    return min(times) if times else None
