"""Why a pod waits, as structured facts computed by the core's own rules (pure).

:func:`diagnose` answers for one pod of a folded state what the scheduler and the
preemption planner would do with it *now*, by calling the very functions they call
(``schedule``, ``plan_preemption``, ``eligibility``, ``reservation_gpu``,
``fits``): an explanation rendered from a :class:`Diagnosis` cannot disagree with
the decision the services make on the same state.

It says, for the pod and for the head of its node's queue:

* on each GPU: the room left, whether the pod fits, and which resource is short;
* which running pods are eligible victims for the head (and the reason), and for
  every other running pod why it is not (static, being preempted already, higher
  priority, not held long enough, ...);
* for each GPU whether preempting every eligible pod there would free enough;
* what backfill would do for a pod behind the head (the reserved GPU, where else it fits);
* the verdict: the one rule that decides what happens next.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, Literal

from gpupool.core.decide import schedule
from gpupool.core.placement import (
    choose_gpu,
    fits,
    gpu_usage,
    ready_queue,
    reservation_gpu,
    subtract,
)
from gpupool.core.preemption import (
    PreemptionPlan,
    eligibility,
    next_preemption_check,
    plan_preemption,
)
from gpupool.core.state import GPU_PERCENT, Phase, PodState, State
from gpupool.events import Assigned, PodRef, PreemptReason, Share

Resource = Literal["core", "memory"]

Ineligibility = Literal[
    "static",
    "being-preempted",
    "not-running",
    "higher-priority",
    "same-priority-no-max-duration",
    "same-priority-held-too-briefly",
]
"""Why a running pod may not be preempted for the head (the cases ``eligibility`` rejects)."""

Verdict = Literal[
    "not-waiting",
    "not-share-pool",
    "no-gpus-known",
    "assigned-next-pass",
    "queue-moving",
    "head-of-line",
    "backfill-reserved",
    "backfill-no-room",
    "preemption-under-way",
    "preemption-disabled",
    "preemption-due",
    "no-eligible-victim",
    "victims-free-too-little",
]
"""What decides the pod's next step.

* ``assigned-next-pass``: ``schedule`` assigns it now (``assigned_gpu``).
* ``queue-moving``: ``schedule`` assigns other pods now (``moving``), not it: the state has
  not settled, and the pod's case is decided again after that pass.
* ``head-of-line``: a pod behind the head, backfill off: it waits for the head.
* ``backfill-reserved``: backfill on; it fits only the GPU reserved for the head.
* ``backfill-no-room``: backfill on; it fits no GPU at all.
* the others are about the head (the pod itself or the head ahead of it) fitting nowhere:
  a preemption is under way, preemption is off, one is due (``plan``), no running pod is
  eligible, or the eligible ones free too little on every GPU.
"""


@dataclass(frozen=True, slots=True)
class GpuRoom:
    index: int
    used: Share
    """Sum of the limits of the share-pool pods holding a slot on it."""
    free: Share
    fits: bool
    """Whether the pod's limits fit in ``free`` (``placement.fits``)."""
    short: tuple[Resource, ...]
    """The resources that are short for it (empty when it fits)."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """A running pod of the node, judged as a victim for the head."""

    pod: PodRef
    gpu_index: int
    priority: int
    running_since: datetime | None
    limits: Share
    eligible: PreemptReason | None
    """``preemption.eligibility``'s answer: why it may be preempted, or None."""
    ineligible: Ineligibility | None
    """When not eligible: which rule protects it."""


@dataclass(frozen=True, slots=True)
class VictimRoom:
    """On one GPU: what preempting every eligible pod there would leave for the head."""

    gpu_index: int
    eligible: tuple[PodRef, ...]
    freed: Share
    """The GPU's usage with every eligible pod's limits removed."""
    enough: bool


@dataclass(frozen=True, slots=True)
class Diagnosis:
    pod: PodRef
    node: str
    phase: Phase
    now: datetime
    verdict: Verdict
    policy: str | None = None
    position: int | None = None
    queue_length: int = 0
    head: PodRef | None = None
    head_priority: int | None = None
    head_limits: Share | None = None
    limits: Share | None = None
    gpus: tuple[GpuRoom, ...] = ()
    """Room for this pod on each GPU."""
    head_gpus: tuple[GpuRoom, ...] = ()
    """Room for the head on each GPU (the same as ``gpus`` when the pod is the head)."""
    assigned_gpu: int | None = None
    """The GPU ``schedule`` gives the pod now, if it does."""
    moving: tuple[PodRef, ...] = ()
    """Other pods ``schedule`` assigns now, in its order."""
    backfill: bool = False
    reserved_gpu: int | None = None
    """With backfill, the GPU held for the head (``reservation_gpu``); None without."""
    backfill_gpus: tuple[int, ...] = ()
    """GPUs other than the reserved one that the pod fits (backfill would use the first)."""
    preempt_enabled: bool = False
    max_duration_minutes: int | None = None
    evicting: tuple[tuple[PodRef, int, PodRef], ...] = ()
    """Preemptions under way on the node: (victim, GPU, preemptor)."""
    candidates: tuple[Candidate, ...] = ()
    victim_rooms: tuple[VictimRoom, ...] = ()
    plan: PreemptionPlan | None = None
    """What ``plan_preemption`` plans now for the head."""
    next_check: datetime | None = None
    """When a running pod next reaches podMaxDurationMinutes (``next_preemption_check``)."""


def rooms(usage: dict[int, Share], want: Share) -> tuple[GpuRoom, ...]:
    found = []
    for index in sorted(usage):
        used = usage[index]
        free = Share(core=GPU_PERCENT - used.core, memory=GPU_PERCENT - used.memory)
        short: list[Resource] = []
        if used.core + want.core > GPU_PERCENT:
            short.append("core")
        if used.memory + want.memory > GPU_PERCENT:
            short.append("memory")
        found.append(
            GpuRoom(index=index, used=used, free=free, fits=fits(used, want), short=tuple(short))
        )
    return tuple(found)


def ineligibility(
    candidate: PodState, head: PodState, minutes: int | None, now: datetime
) -> Ineligibility:
    """Which rule of ``eligibility`` protects ``candidate`` (call only when it returned None)."""
    if candidate.policy != "share-pool":
        return "static"
    if candidate.evicted_by is not None:
        return "being-preempted"
    if candidate.phase != "running" or candidate.running_since is None:
        return "not-running"
    if candidate.priority > head.priority:
        return "higher-priority"
    if minutes is None:
        return "same-priority-no-max-duration"
    assert now - candidate.running_since < timedelta(minutes=minutes)
    return "same-priority-held-too-briefly"


def diagnose(state: State, pod_ref: PodRef, now: datetime) -> Diagnosis:
    """The structured reasons why ``pod_ref`` waits (or what happens to it next), at ``now``."""
    pod = state.pods[pod_ref]
    node = state.node(pod.node) if pod.node in state.nodes else None
    if pod.phase != "ready" or node is None:
        return Diagnosis(
            pod=pod_ref, node=pod.node, phase=pod.phase, now=now, verdict="not-waiting"
        )
    base = Diagnosis(
        pod=pod_ref,
        node=pod.node,
        phase=pod.phase,
        now=now,
        verdict="not-share-pool",
        policy=node.policy,
        limits=pod.limits,
        backfill=node.qos.backfill,
        preempt_enabled=node.qos.preempt_enabled,
        max_duration_minutes=node.qos.pod_max_duration_minutes,
    )
    if node.policy != "share-pool":
        return base
    if not node.gpus:
        return _replace(base, verdict="no-gpus-known")
    pods = state.pods_on(pod.node)
    queue = ready_queue(state, pod.node)
    position = next(i for i, queued in enumerate(queue, start=1) if queued.ref == pod_ref)
    head = queue[0]
    usage = gpu_usage(node, pods)
    passing = [event for event in schedule(state, pod.node, now) if isinstance(event, Assigned)]
    assigned = [event.gpu_index for event in passing if event.pod == pod_ref]
    moving = tuple(event.pod for event in passing if event.pod != pod_ref)
    reserved = (
        reservation_gpu(usage, head, pods) if node.qos.backfill and head.ref != pod_ref else None
    )
    backfill_gpus: tuple[int, ...] = ()
    if node.qos.backfill and head.ref != pod_ref:
        elsewhere = choose_gpu(usage, pod.limits, exclude=reserved)
        others = tuple(
            room.index for room in rooms(usage, pod.limits) if room.fits and room.index != reserved
        )
        # best fit first, as schedule() would take it
        backfill_gpus = (
            (elsewhere, *(i for i in others if i != elsewhere)) if elsewhere is not None else ()
        )
    candidates = []
    for other in pods:
        if other.phase != "running" or other.gpu_index is None:
            continue
        reason = eligibility(other, head, node, now)
        candidates.append(
            Candidate(
                pod=other.ref,
                gpu_index=other.gpu_index,
                priority=other.priority,
                running_since=other.running_since,
                limits=other.limits,
                eligible=reason,
                ineligible=None
                if reason is not None
                else ineligibility(other, head, node.qos.pod_max_duration_minutes, now),
            )
        )
    candidates.sort(key=lambda c: (c.gpu_index, c.pod.namespace, c.pod.name))
    victim_rooms = []
    for index in sorted(usage):
        chosen = [c for c in candidates if c.gpu_index == index and c.eligible is not None]
        freed = usage[index]
        for c in chosen:
            freed = subtract(freed, c.limits)
        victim_rooms.append(
            VictimRoom(
                gpu_index=index,
                eligible=tuple(c.pod for c in chosen),
                freed=freed,
                enough=bool(chosen) and fits(freed, head.limits),
            )
        )
    evicting = tuple(
        (p.ref, p.gpu_index, p.evicted_by)
        for p in pods
        if p.evicted_by is not None and p.gpu_index is not None
    )
    plan = plan_preemption(state, pod.node, usage, now)
    head_rooms = rooms(usage, head.limits)
    diagnosis = _replace(
        base,
        position=position,
        queue_length=len(queue),
        head=head.ref,
        head_priority=head.priority,
        head_limits=head.limits,
        gpus=rooms(usage, pod.limits),
        head_gpus=head_rooms,
        assigned_gpu=assigned[0] if assigned else None,
        moving=moving,
        reserved_gpu=reserved,
        backfill_gpus=backfill_gpus,
        evicting=evicting,
        candidates=tuple(candidates),
        victim_rooms=tuple(victim_rooms),
        plan=plan,
        next_check=next_preemption_check(state, pod.node, now),
    )
    return _replace(diagnosis, verdict=_verdict(diagnosis, head.ref == pod_ref))


def _verdict(d: Diagnosis, is_head: bool) -> Verdict:
    if d.assigned_gpu is not None:
        return "assigned-next-pass"
    if d.moving:
        return "queue-moving"
    if not is_head:
        if not d.backfill:
            return "head-of-line"
        if any(room.fits for room in d.gpus):
            return "backfill-reserved"
        return "backfill-no-room"
    if d.evicting:
        return "preemption-under-way"
    if not d.preempt_enabled:
        return "preemption-disabled"
    if d.plan is not None:
        return "preemption-due"
    if not any(c.eligible is not None for c in d.candidates):
        return "no-eligible-victim"
    return "victims-free-too-little"


def _replace(d: Diagnosis, **changes: Any) -> Diagnosis:
    return replace(d, **changes)
