"""Who held which GPU when: one interval per assignment (pod, GPU, from, to, how it ended).

An interval opens at ``Assigned`` and closes at the pod's ``Released`` of that GPU
(its reason: completed, failed, preempted, ...) or at ``PodRemoved``; a
``Preempted`` on it marks when and for whom it was asked to let go. An interval
still open at the end of the window has ``end`` None and ``ended`` ``holding``.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

import msgspec

from gpupool.eventlog.port import Entry, StoredEvent
from gpupool.events import (
    Assigned,
    PodRef,
    PodRegistered,
    PodRemoved,
    Preempted,
    Released,
    Share,
)

HOLDING = "holding"
REMOVED = "removed"


class GpuInterval(msgspec.Struct, frozen=True, kw_only=True):
    pod: PodRef
    node: str
    gpu_index: int
    gpu_uuid: str
    start: datetime
    end: datetime | None
    ended: str
    """The release reason (completed, failed, preempted, ...), ``removed``, or ``holding``."""
    priority: int = 0
    limits: Share | None = None
    preempted_at: datetime | None = None
    preempted_by: PodRef | None = None
    preempt_reason: str | None = None
    start_seq: int = 0
    start_index: int = 0
    """The Assigned's place in its log entry (one decision entry can assign several pods)."""
    end_seq: int | None = None


def gpu_intervals(
    entries: Sequence[Entry],
    *,
    node: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
) -> list[GpuInterval]:
    """Every GPU interval that overlaps [since, until] (open ends: the whole log), by start.

    Entries after ``until`` are not read: an interval still open then is ``holding``.
    """
    registered: dict[PodRef, PodRegistered] = {}
    open_: dict[PodRef, GpuInterval] = {}
    done: list[GpuInterval] = []
    for entry in entries:
        if not isinstance(entry, StoredEvent):
            continue
        envelope = entry.envelope
        if until is not None and envelope.time > until:
            break
        event = envelope.event
        if node is not None and event.node != node:
            continue
        match event:
            case PodRegistered():
                registered[event.pod] = event
            case Assigned():
                info = registered.get(event.pod)
                open_[event.pod] = GpuInterval(
                    pod=event.pod,
                    node=event.node,
                    gpu_index=event.gpu_index,
                    gpu_uuid=event.gpu_uuid,
                    start=envelope.time,
                    end=None,
                    ended=HOLDING,
                    priority=info.priority if info is not None else 0,
                    limits=info.limits if info is not None else None,
                    start_seq=entry.seq,
                    start_index=entry.index,
                )
            case Preempted() if event.victim in open_:
                open_[event.victim] = msgspec.structs.replace(
                    open_[event.victim],
                    preempted_at=envelope.time,
                    preempted_by=event.preemptor,
                    preempt_reason=event.reason,
                )
            case Released() if event.gpu_index is not None and event.pod in open_:
                done.append(
                    msgspec.structs.replace(
                        open_.pop(event.pod),
                        end=envelope.time,
                        ended=event.reason,
                        end_seq=entry.seq,
                    )
                )
            case PodRemoved() if event.pod in open_:
                done.append(
                    msgspec.structs.replace(
                        open_.pop(event.pod), end=envelope.time, ended=REMOVED, end_seq=entry.seq
                    )
                )
            case _:
                pass
    found = [*done, *open_.values()]
    if since is not None:
        found = [i for i in found if i.end is None or i.end >= since]
    found.sort(key=lambda i: (i.start_seq, i.start_index, i.gpu_index))
    return found
