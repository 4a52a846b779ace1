"""The outcome of a run, read from the log: what a client that reattaches late is told.

A ``gpupool run`` client that lost its executor reconnects with ``reattach: true`` and the
time it first sent its request. If no run of its pod is in progress here, its true outcome is
in the log: the pod's last ``Released`` after that time (reason and exit code). If the log
has neither a release nor a ``PodReady`` of the pod since then, the executor never acted on
the request (it went away first): nothing ran, and the request can be served as new.

:class:`OutcomeBook` folds this from the entries the service folds (a projection observer);
entries older than the projection it was attached to (a snapshot, or the rebuild before the
executor started) are read once from the log, on the first question that needs them.
"""

from __future__ import annotations

import asyncio
from datetime import datetime

import msgspec

from gpupool.core import State
from gpupool.eventlog.port import EventLog, StoredEvent
from gpupool.events import Envelope, PodReady, PodRef, Released, ReleaseReason
from gpupool.runtime.projection import Observer


class LoggedRelease(msgspec.Struct, frozen=True, kw_only=True):
    seq: int
    time: datetime
    reason: ReleaseReason
    exit_code: int | None


class OutcomeBook:
    """Per pod of one node: its last Released and the time of its last PodReady."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.releases: dict[PodRef, LoggedRelease] = {}
        self.ready_at: dict[PodRef, datetime] = {}
        self.observed_after = 0
        """Entries up to this sequence were not observed live: :meth:`backfill` reads them."""
        self._backfilled = False
        self._lock = asyncio.Lock()
        self.backfilled_entries = 0

    def attach(self, observers: list[Observer], last_seq: int) -> None:
        """Observe every entry folded from now on; the ones up to ``last_seq`` come by backfill."""
        observers.append(self.observe)
        self.observed_after = last_seq
        self._backfilled = last_seq == 0

    def observe(self, state: State, envelope: Envelope, seq: int) -> None:
        self._note(envelope, seq)

    def _note(self, envelope: Envelope, seq: int) -> None:
        event = envelope.event
        if event.node != self.node:
            return
        if isinstance(event, Released):
            known = self.releases.get(event.pod)
            if known is None or known.seq <= seq:
                self.releases[event.pod] = LoggedRelease(
                    seq=seq, time=envelope.time, reason=event.reason, exit_code=event.exit_code
                )
        elif isinstance(event, PodReady):
            known_time = self.ready_at.get(event.pod)
            if known_time is None or known_time <= envelope.time:
                self.ready_at[event.pod] = envelope.time

    async def backfill(self, log: EventLog) -> None:
        """Read, once, the node's entries that were folded before this book observed."""
        async with self._lock:
            if self._backfilled:
                return
            entries = log.replay(node=self.node, from_seq=1)
            try:
                async for entry in entries:
                    if entry.seq > self.observed_after:
                        break
                    if isinstance(entry, StoredEvent):
                        self.backfilled_entries += 1
                        self._note(entry.envelope, entry.seq)
            finally:
                close = getattr(entries, "aclose", None)
                if close is not None:  # stop the replay at once rather than when collected
                    await close()
            self._backfilled = True

    def release_since(self, pod: PodRef, since: datetime) -> LoggedRelease | None:
        """The pod's last release, if it was recorded at or after ``since``."""
        release = self.releases.get(pod)
        return release if release is not None and release.time >= since else None

    def ready_since(self, pod: PodRef, since: datetime) -> bool:
        ready = self.ready_at.get(pod)
        return ready is not None and ready >= since
