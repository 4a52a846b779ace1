"""``gpupool history``'s model and the console's pod page: every step of one pod.

Registered, ready (and its position), each change of position while it waits (and
which event moved it), its GPU, preemptions on either side, releases, removal.
Each :class:`PodStep` is data; the CLI and the console word it.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any, Literal

import msgspec

from gpupool.audit.errors import AuditError
from gpupool.audit.log import involves, log_origin
from gpupool.core import queue_positions
from gpupool.eventlog.port import Entry as LogEntry
from gpupool.eventlog.port import StoredEvent, Undecodable
from gpupool.eventlog.subjects import writer_of_subject
from gpupool.events import (
    Assigned,
    Event,
    PodReady,
    PodRef,
    PodRegistered,
    PodRejected,
    PodRemoved,
    Preempted,
    Released,
    Share,
    event_tag,
)
from gpupool.runtime.projection import Projection

StepKind = Literal[
    "registered",
    "rejected",
    "ready",
    "moved",
    "assigned",
    "bound",
    "preempted",
    "preempts",
    "released",
    "left-queue",
    "removed",
]


class QueueCause(msgspec.Struct, frozen=True, kw_only=True):
    """The event that moved a waiting pod: who, and what happened to them."""

    pod: PodRef | None
    what: str
    """``assigned`` (with ``gpu_index``), ``joined``, ``left`` (with ``reason``), ``removed``,
    or the event's type tag."""
    gpu_index: int | None = None
    reason: str = ""


class PodStep(msgspec.Struct, frozen=True, kw_only=True):
    seq: int
    time: datetime
    kind: StepKind
    node: str
    gpu_index: int | None = None
    gpu_uuid: str = ""
    position: int | None = None
    queue_length: int | None = None
    was: int | None = None
    """For ``moved``: the position before."""
    positions: list[int] = []
    """For ``assigned``/``left-queue``: every position it held while it waited."""
    other: PodRef | None = None
    """The preemptor (``preempted``) or the victim (``preempts``)."""
    reason: str = ""
    cause: QueueCause | None = None
    waited: timedelta | None = None
    held: timedelta | None = None
    exit_code: int | None = None
    policy: str = ""
    requests: Share | None = None
    limits: Share | None = None
    priority: int | None = None
    message: str = ""
    phase_before: str = ""


class History(msgspec.Struct, frozen=True, kw_only=True):
    pod: PodRef
    node: str
    origin: datetime
    steps: list[PodStep]


def queue_cause(event: Event) -> QueueCause:
    """Why the queue changed, seen from a pod waiting in it."""
    match event:
        case Assigned():
            return QueueCause(pod=event.pod, what="assigned", gpu_index=event.gpu_index)
        case PodReady():
            return QueueCause(pod=event.pod, what="joined")
        case Released() if event.gpu_index is None:
            return QueueCause(pod=event.pod, what="left", reason=event.reason)
        case PodRemoved():
            return QueueCause(pod=event.pod, what="removed")
        case Preempted():
            return QueueCause(pod=event.victim, what=event_tag(event))
    pod = getattr(event, "pod", None)
    return QueueCause(pod=pod if isinstance(pod, PodRef) else None, what=event_tag(event))


class _Wait:
    def __init__(self, since: datetime, position: int) -> None:
        self.since = since
        self.positions = [position]


def pod_history(entries: Sequence[LogEntry], pod: PodRef) -> History:
    """Every step of one pod, in log order, with its queue positions."""
    origin = log_origin(entries)
    projection = Projection()
    steps: list[PodStep] = []
    node = ""
    wait: _Wait | None = None
    for entry in entries:
        if isinstance(entry, Undecodable):
            projection.skip(entry.seq, None)
            continue
        envelope = entry.envelope
        event = envelope.event
        before = projection.state.pods.get(pod)
        held_since = before.running_since if before is not None else None
        projection.apply(
            entry.seq,
            envelope,
            index=entry.index,
            last=entry.last,
            writer=writer_of_subject(entry.subject),
        )
        state = projection.state
        mine = involves(event, pod)
        if isinstance(event, PodRegistered | PodRejected) and event.pod == pod:
            node = event.node
        if not mine and (wait is None or event.node != node):
            continue
        now = envelope.time
        held = now - held_since if held_since is not None else None

        def step(
            kind: StepKind, entry: StoredEvent = entry, node: str = node, **fields: Any
        ) -> None:
            steps.append(
                PodStep(seq=entry.seq, time=entry.envelope.time, kind=kind, node=node, **fields)
            )

        match event:
            case PodRegistered() if mine:
                step(
                    "registered",
                    policy=event.policy,
                    requests=event.requests,
                    limits=event.limits,
                    priority=event.priority,
                )
            case PodRejected() if mine:
                step("rejected", reason=event.reason, message=event.message)
            case PodReady() if mine:
                positions = queue_positions(state, event.node)
                position = positions.get(pod, 0)
                wait = _Wait(now, position)
                step("ready", position=position, queue_length=len(positions))
            case Assigned() if mine:
                if wait is None:
                    step("bound", gpu_index=event.gpu_index, gpu_uuid=event.gpu_uuid)
                else:
                    step(
                        "assigned",
                        gpu_index=event.gpu_index,
                        gpu_uuid=event.gpu_uuid,
                        waited=now - wait.since,
                        positions=list(wait.positions),
                    )
                wait = None
            case Preempted() if event.victim == pod:
                step(
                    "preempted",
                    other=event.preemptor,
                    gpu_index=event.gpu_index,
                    reason=event.reason,
                    held=held,
                )
            case Preempted() if event.preemptor == pod:
                step("preempts", other=event.victim, gpu_index=event.gpu_index, reason=event.reason)
            case Released() if mine:
                if event.gpu_index is None:
                    step(
                        "left-queue",
                        reason=event.reason,
                        waited=now - wait.since if wait else None,
                        positions=list(wait.positions) if wait else [],
                    )
                else:
                    step(
                        "released",
                        gpu_index=event.gpu_index,
                        reason=event.reason,
                        exit_code=event.exit_code,
                        held=held,
                    )
                wait = None
            case PodRemoved() if mine:
                step("removed", phase_before=before.phase if before is not None else "")
                wait = None
            case _ if wait is not None and event.node == node:
                positions = queue_positions(state, node)
                moved_to = positions.get(pod)
                if moved_to is not None and moved_to != wait.positions[-1]:
                    step(
                        "moved",
                        position=moved_to,
                        queue_length=len(positions),
                        was=wait.positions[-1],
                        cause=queue_cause(event),
                    )
                    wait.positions.append(moved_to)
    if origin is None or not steps:
        raise AuditError(f"pod {pod} does not appear in the log")
    return History(pod=pod, node=node, origin=origin, steps=steps)
