"""``gpupool explain``'s model: why a pod waits, as reasons taken from the core's diagnosis.

:func:`reasons` turns a :class:`~gpupool.core.diagnosis.Diagnosis` into a list of
:class:`Reason` values, one fact each (a GPU the pod does not fit and which
resource is short, a running pod that may or may not be preempted and why, what
backfill does, what happens next). Every reason is read off the diagnosis, which
the core computes with the scheduler's and the preemption planner's own
functions; nothing here re-implements a rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Literal

import msgspec

from gpupool.audit.errors import AuditError
from gpupool.audit.estimate import WaitEstimate, estimate_wait
from gpupool.audit.fold import fold_until
from gpupool.audit.history import PodStep, pod_history
from gpupool.audit.log import log_origin
from gpupool.audit.state import QueuedPod
from gpupool.core import ready_queue
from gpupool.core.diagnosis import Diagnosis, diagnose
from gpupool.eventlog.port import Entry
from gpupool.events import PodRef, Share

ReasonKind = Literal[
    "not-share-pool",
    "no-gpus-known",
    "gpu-fits",
    "gpu-too-full",
    "reserved-for-head",
    "assigned-next-pass",
    "queue-moving",
    "head-of-line",
    "backfill-off",
    "backfill-reserved-only",
    "backfill-no-room",
    "head-fits-nowhere",
    "preemption-under-way",
    "preemption-disabled",
    "victim-eligible",
    "victim-protected",
    "victims-free-too-little",
    "preemption-due",
    "next-check",
]


class Reason(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One fact about why the pod waits. Which fields are set depends on ``kind``."""

    kind: ReasonKind
    gpu_index: int | None = None
    pod: PodRef | None = None
    """The other pod the fact is about (the head, a candidate victim, a pod being preempted)."""
    preemptor: PodRef | None = None
    short: list[str] = []
    used: Share | None = None
    free: Share | None = None
    needs: Share | None = None
    why: str = ""
    """For ``victim-eligible``: priority or max-duration; ``victim-protected``: the rule."""
    priority: int | None = None
    head_priority: int | None = None
    minutes: int | None = None
    policy: str | None = None
    victims: list[PodRef] = []
    at: datetime | None = None


def reasons(d: Diagnosis) -> list[Reason]:
    """Every fact of the diagnosis worth saying, most decisive last (the verdict's own facts)."""
    if d.verdict == "not-waiting":
        return []
    if d.verdict == "not-share-pool":
        return [Reason(kind="not-share-pool", policy=d.policy)]
    if d.verdict == "no-gpus-known":
        return [Reason(kind="no-gpus-known")]
    said: list[Reason] = []
    for room in d.gpus:
        if room.fits:
            said.append(Reason(kind="gpu-fits", gpu_index=room.index, free=room.free))
        else:
            said.append(
                Reason(
                    kind="gpu-too-full",
                    gpu_index=room.index,
                    used=room.used,
                    free=room.free,
                    needs=d.limits,
                    short=list(room.short),
                )
            )
        if d.reserved_gpu == room.index:
            said.append(Reason(kind="reserved-for-head", gpu_index=room.index, pod=d.head))
    if d.verdict == "assigned-next-pass":
        said.append(Reason(kind="assigned-next-pass", gpu_index=d.assigned_gpu))
        return said
    if d.verdict == "queue-moving":
        said.append(Reason(kind="queue-moving", victims=list(d.moving)))
        return said
    is_head = d.head == d.pod
    if not is_head:
        said.append(Reason(kind="head-of-line", pod=d.head, priority=d.head_priority))
        if d.verdict == "head-of-line":
            fitting = [room.index for room in d.gpus if room.fits]
            if fitting:
                said.append(Reason(kind="backfill-off", gpu_index=fitting[0]))
        elif d.verdict == "backfill-reserved":
            said.append(Reason(kind="backfill-reserved-only", gpu_index=d.reserved_gpu))
        elif d.verdict == "backfill-no-room":
            said.append(Reason(kind="backfill-no-room", needs=d.limits))
    if not any(room.fits for room in d.head_gpus):
        said.append(Reason(kind="head-fits-nowhere", pod=d.head, needs=d.head_limits))
    for victim, gpu, preemptor in d.evicting:
        said.append(
            Reason(kind="preemption-under-way", pod=victim, gpu_index=gpu, preemptor=preemptor)
        )
    if d.evicting:
        return said
    if not d.preempt_enabled:
        said.append(Reason(kind="preemption-disabled"))
        return said
    for c in d.candidates:
        if c.eligible is not None:
            said.append(
                Reason(
                    kind="victim-eligible",
                    pod=c.pod,
                    gpu_index=c.gpu_index,
                    why=c.eligible,
                    priority=c.priority,
                    head_priority=d.head_priority,
                )
            )
        else:
            said.append(
                Reason(
                    kind="victim-protected",
                    pod=c.pod,
                    gpu_index=c.gpu_index,
                    why=c.ineligible or "",
                    priority=c.priority,
                    head_priority=d.head_priority,
                    minutes=d.max_duration_minutes,
                )
            )
    if d.plan is not None:
        said.append(
            Reason(
                kind="preemption-due",
                gpu_index=d.plan.gpu_index,
                victims=[v.pod.ref for v in d.plan.victims],
                preemptor=d.plan.head.ref,
            )
        )
        return said
    for victim_room in d.victim_rooms:
        if victim_room.eligible and not victim_room.enough:
            said.append(
                Reason(
                    kind="victims-free-too-little",
                    gpu_index=victim_room.gpu_index,
                    victims=list(victim_room.eligible),
                    free=victim_room.freed,
                    needs=d.head_limits,
                )
            )
    if d.next_check is not None and d.max_duration_minutes is not None:
        limit = timedelta(minutes=d.max_duration_minutes)
        reaching = [
            c.pod
            for c in d.candidates
            if c.running_since is not None and c.running_since + limit == d.next_check
        ]
        said.append(
            Reason(
                kind="next-check",
                at=d.next_check,
                minutes=d.max_duration_minutes,
                victims=reaching,
            )
        )
    return said


class Explanation(msgspec.Struct, frozen=True, kw_only=True):
    pod: PodRef
    node: str
    at: datetime
    origin: datetime
    phase: str
    """``waiting``, ``running``, ``dormant`` or ``unregistered``."""
    position: int | None = None
    queue_length: int = 0
    ready_since: datetime | None = None
    gpu_index: int | None = None
    running_since: datetime | None = None
    evicted_by: PodRef | None = None
    evict_reason: str | None = None
    last_step: PodStep | None = None
    """For an unregistered pod: its last step in the log before ``at``."""
    ahead: list[QueuedPod] = []
    needs: Share | None = None
    verdict: str = ""
    reasons: list[Reason] = []
    estimate: WaitEstimate | None = None


def explain(entries: Sequence[Entry], pod_ref: PodRef, at: datetime | None = None) -> Explanation:
    """Why the pod waits (or that it does not), as of ``at`` (default: the log's last entry)."""
    origin = log_origin(entries)
    if origin is None:
        raise AuditError("the log has no readable entries")
    folded = fold_until(entries, at)
    now = at if at is not None else (folded.last.envelope.time if folded.last else origin)
    state = folded.state
    pod = state.pods.get(pod_ref)
    if pod is None:
        history = pod_history(entries, pod_ref)  # raises AuditError if the pod never appears
        before = [step for step in history.steps if step.time <= now]
        return Explanation(
            pod=pod_ref,
            node=history.node,
            at=now,
            origin=origin,
            phase="unregistered",
            last_step=before[-1] if before else None,
        )
    if pod.phase != "ready":
        return Explanation(
            pod=pod_ref,
            node=pod.node,
            at=now,
            origin=origin,
            phase="running" if pod.phase == "running" else "dormant",
            gpu_index=pod.gpu_index,
            running_since=pod.running_since,
            evicted_by=pod.evicted_by,
            evict_reason=pod.evict_reason,
        )
    diagnosis = diagnose(state, pod_ref, now)
    queue = ready_queue(state, pod.node)
    position = diagnosis.position or 0
    ahead = [
        QueuedPod(
            position=i,
            pod=queued.ref,
            priority=queued.priority,
            limits=queued.limits,
            ready_since=queued.ready_since,
        )
        for i, queued in enumerate(queue[: position - 1], start=1)
    ]
    return Explanation(
        pod=pod_ref,
        node=pod.node,
        at=now,
        origin=origin,
        phase="waiting",
        position=position,
        queue_length=len(queue),
        ready_since=pod.ready_since,
        ahead=ahead,
        needs=pod.limits,
        verdict=diagnosis.verdict,
        reasons=reasons(diagnosis),
        estimate=estimate_wait(state.nodes[pod.node], position, folded.holds),
    )
