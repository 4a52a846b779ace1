"""``gpupool log``'s model: the entries of the log, filtered by pod, node, type and time."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

import msgspec

from gpupool.eventlog.port import Entry, StoredEvent, Undecodable
from gpupool.events import Event, PodRef, Preempted, event_tag

UNDECODABLE_TYPE = "Undecodable"
"""The type an entry whose bytes are not an envelope is shown with."""


def stored_events(entries: Iterable[Entry]) -> list[StoredEvent]:
    return [entry for entry in entries if isinstance(entry, StoredEvent)]


def log_origin(entries: Iterable[Entry]) -> datetime | None:
    """The time of the first readable entry: offsets like ``+65s`` count from it."""
    for entry in entries:
        if isinstance(entry, StoredEvent):
            return entry.envelope.time
    return None


def involves(event: Event, pod: PodRef) -> bool:
    """Whether the event is about the pod (as the victim or the preemptor of a Preempted too)."""
    if isinstance(event, Preempted):
        return pod in (event.victim, event.preemptor)
    return getattr(event, "pod", None) == pod


class LogFilter(msgspec.Struct, frozen=True, kw_only=True):
    pod: PodRef | None = None
    node: str | None = None
    types: frozenset[str] = frozenset()
    since: datetime | None = None
    until: datetime | None = None


def entry_matches(entry: Entry, selection: LogFilter) -> bool:
    """Undecodable entries have no time, node or pod: they match only filters by type or none."""
    if isinstance(entry, Undecodable):
        if selection.pod is not None or selection.node is not None:
            return False
        return not selection.types or UNDECODABLE_TYPE in selection.types
    envelope = entry.envelope
    event = envelope.event
    if selection.types and event_tag(event) not in selection.types:
        return False
    if selection.node is not None and event.node != selection.node:
        return False
    if selection.pod is not None and not involves(event, selection.pod):
        return False
    if selection.since is not None and envelope.time < selection.since:
        return False
    return selection.until is None or envelope.time <= selection.until


def select_entries(entries: Iterable[Entry], selection: LogFilter) -> list[Entry]:
    return [entry for entry in entries if entry_matches(entry, selection)]
