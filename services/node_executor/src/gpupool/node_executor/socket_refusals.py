"""Every refusal at the workload socket is recorded, and a flood of them costs one event per interval.

The first ``individually_per_interval`` refusals of an interval are recorded one by one (as
``MessageRejected`` with subject ``socket:<path>``: reason, caller, the bytes); the ones after
that are only counted, and at the end of the interval one summary is recorded with their
counts by reason and by caller (``MessageRejected`` whose reason starts with
``SocketRefusals:`` and whose payload is the :class:`RefusalSummary` as JSON). So a client
that sends 20,000 bad requests a second adds a handful of entries to the log, not 20,000,
and none of its refusals goes unrecorded.

:meth:`RefusalLog.refuse` never waits: the socket answers at once and the recording happens
in the background (in order); :meth:`RefusalLog.close` records what is still pending.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable

import msgspec

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_SECONDS = 5.0
DEFAULT_INDIVIDUALLY_PER_INTERVAL = 10
MAX_PEERS_NAMED = 20
"""A summary names at most this many callers; the rest are added up as ``others``."""
SUMMARY_REASON = "SocketRefusals"


class Refusal(msgspec.Struct, frozen=True, kw_only=True):
    """One request (or connection) refused at the socket."""

    reason: str
    """Machine-readable: ``bad-request``, ``too-many-fds``, ``rate-limited``, …"""
    message: str
    pid: int
    uid: int
    data: bytes = b""

    @property
    def peer(self) -> str:
        return f"uid {self.uid} pid {self.pid}"


class RefusalSummary(msgspec.Struct, frozen=True, kw_only=True):
    """Refusals of one interval that were counted, not recorded one by one."""

    interval_seconds: float
    refusals: int
    by_reason: dict[str, int]
    by_peer: dict[str, int]
    """``uid U pid P`` → count; at most ``MAX_PEERS_NAMED`` named, the rest under ``others``."""

    def describe(self) -> str:
        reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(self.by_reason.items()))
        peers = ", ".join(f"{peer} ({count})" for peer, count in self.by_peer.items())
        return (
            f"{SUMMARY_REASON}: {self.refusals} more refusals in {self.interval_seconds:.1f}s "
            f"({reasons}) from {peers}"
        )


RecordOne = Callable[[Refusal], Awaitable[None]]
RecordSummary = Callable[[RefusalSummary], Awaitable[None]]


class RefusalLog:
    """Records refusals in the background: each one, or, past the budget, counted in a summary."""

    def __init__(
        self,
        record_one: RecordOne,
        record_summary: RecordSummary,
        *,
        interval_seconds: float = DEFAULT_INTERVAL_SECONDS,
        individually_per_interval: int = DEFAULT_INDIVIDUALLY_PER_INTERVAL,
    ) -> None:
        self._record_one = record_one
        self._record_summary = record_summary
        self._interval = interval_seconds
        self._budget = individually_per_interval
        self._pending: list[Refusal] = []
        self._window_start: float | None = None
        self._recorded_in_window = 0
        self._by_reason: Counter[str] = Counter()
        self._by_peer: Counter[str] = Counter()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self.total: Counter[str] = Counter()
        """Every refusal so far, by reason (recorded one by one or in a summary)."""
        self.recorded_individually = 0
        self.summaries = 0

    def refuse(self, refusal: Refusal) -> None:
        """Count ``refusal`` and have it recorded; never waits."""
        if self._count(refusal):
            self._pending.append(refusal)
        self._start()

    def claim(self, refusal: Refusal) -> bool:
        """Count ``refusal``; True when the caller is to record it itself (its own event, e.g.
        PodRejected), False when it was counted for the interval's summary instead."""
        individually = self._count(refusal)
        if not individually:
            self._start()
        self.recorded_individually += individually
        return individually

    def _count(self, refusal: Refusal) -> bool:
        now = asyncio.get_running_loop().time()
        self.total[refusal.reason] += 1
        expired = self._window_start is None or now - self._window_start >= self._interval
        if expired and not self._by_reason:  # the last window's summary is taken: a new one
            self._window_start = now
            self._recorded_in_window = 0
        if self._recorded_in_window < self._budget:
            self._recorded_in_window += 1
            return True
        self._by_reason[refusal.reason] += 1
        self._by_peer[refusal.peer] += 1
        return False

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="socket-refusals")
        self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            await self._drain()
            if self._by_reason:
                assert self._window_start is not None
                due = self._window_start + self._interval
                if self._closing or loop.time() >= due:
                    await self._summarize(loop.time() - self._window_start)
                    continue
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(due - loop.time()):
                        await self._wake.wait()
                continue
            if not self._pending:
                return

    async def _drain(self) -> None:
        while self._pending:
            refusal = self._pending.pop(0)
            try:
                await self._record_one(refusal)
            except Exception:
                log.exception("could not record a refusal at the workload socket")
            self.recorded_individually += 1

    async def _summarize(self, seconds: float) -> None:
        named = self._by_peer.most_common(MAX_PEERS_NAMED)
        by_peer = dict(named)
        others = sum(self._by_peer.values()) - sum(by_peer.values())
        if others:
            by_peer["others"] = others
        summary = RefusalSummary(
            interval_seconds=round(seconds, 3),
            refusals=sum(self._by_reason.values()),
            by_reason=dict(sorted(self._by_reason.items())),
            by_peer=by_peer,
        )
        self._by_reason.clear()
        self._by_peer.clear()
        self._window_start = None
        log.warning("workload socket: %s", summary.describe())
        try:
            await self._record_summary(summary)
        except Exception:
            log.exception("could not record a summary of refusals at the workload socket")
        self.summaries += 1

    async def close(self) -> None:
        """Record everything still pending (the counted ones as a last summary, at once)."""
        self._closing = True
        self._wake.set()
        if self._task is not None and not self._task.done():
            await self._task
