"""Folding a prefix of the log with the services' own projection (the core ``evolve``)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

import msgspec

from gpupool.core import State
from gpupool.eventlog.port import Entry, StoredEvent, Undecodable
from gpupool.eventlog.subjects import writer_of_subject
from gpupool.events import Envelope, PodRef, Released
from gpupool.runtime.projection import Projection


class Hold(msgspec.Struct, frozen=True, kw_only=True):
    """One finished assignment: how long a pod held its GPU and why it let go."""

    pod: PodRef
    node: str
    gpu_index: int
    reason: str
    released_at: datetime
    held: timedelta


class Folded(msgspec.Struct, kw_only=True):
    """A log prefix folded: the projection, the last entry applied, what it saw on the way."""

    projection: Projection
    last: StoredEvent | None = None
    entries: int = 0
    holds: list[Hold] = []

    @property
    def state(self) -> State:
        return self.projection.state


def _record_hold(folded: Folded, state: State, envelope: Envelope) -> None:
    event = envelope.event
    if not isinstance(event, Released) or event.gpu_index is None:
        return
    pod = state.pods.get(event.pod)
    if pod is None or pod.running_since is None:
        return
    folded.holds.append(
        Hold(
            pod=event.pod,
            node=event.node,
            gpu_index=event.gpu_index,
            reason=event.reason,
            released_at=envelope.time,
            held=envelope.time - pod.running_since,
        )
    )


def fold_until(entries: Sequence[Entry], until: datetime | None = None) -> Folded:
    """Fold the log up to ``until``: the prefix that ends before the first entry after it.

    The log's order is the truth; times only pick where the prefix ends (entries
    with the same time as ``until`` are included).
    """
    folded = Folded(projection=Projection())
    folded.projection.observers.append(
        lambda state, envelope, _seq: _record_hold(folded, state, envelope)
    )
    for entry in entries:
        if isinstance(entry, Undecodable):
            folded.projection.skip(entry.seq, None)
            folded.entries += 1
            continue
        if until is not None and entry.envelope.time > until:
            break
        folded.projection.apply(
            entry.seq,
            entry.envelope,
            index=entry.index,
            last=entry.last,
            writer=writer_of_subject(entry.subject),
        )
        folded.last = entry
        folded.entries += 1
    return folded
