"""Counters folded from the log itself, so that they survive restarts and a replay never double-counts.

``LogStatistics.observe`` is a projection observer: it sees each envelope with the
state *before* the envelope is folded, and counts per node

* assignments (``Assigned``),
* preemptions by reason (``Preempted.reason``),
* releases by reason (``Released.reason``),
* rejected pods by reason (``PodRejected.reason``),
* rejected messages (``MessageRejected``, under the node its subject named, ``""`` if none),
* the waiting-time distribution: from the time of the pod's ``PodReady`` to the time
  of the entry that ended the wait (``Assigned``; or ``Released``/``PodRemoved``
  while it was still waiting, i.e. it gave up), both taken from the log's own
  envelope times, never from a clock.

The counts are a pure function of the log prefix, so a restart that rebuilds from
zero, or resumes from a snapshot, produces the same numbers.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from datetime import datetime, timedelta

import msgspec

from gpupool.core import State
from gpupool.events import (
    Assigned,
    Envelope,
    Event,
    MessageRejected,
    PodRef,
    PodRegistered,
    PodRejected,
    PodRemoved,
    Preempted,
    Released,
)

WAIT_BUCKETS_SECONDS: tuple[int, ...] = (
    1,
    5,
    10,
    30,
    60,
    120,
    300,
    600,
    1800,
    3600,
    7200,
    14400,
)
"""Upper bounds (``le``) of the waiting-time histogram, 1 s .. 4 h; a last bucket is ``+Inf``."""

_MICROS = 1_000_000
_BOUNDS_MICROS: tuple[int, ...] = tuple(bound * _MICROS for bound in WAIT_BUCKETS_SECONDS)


def _micros(duration: timedelta) -> int:
    """A duration in whole microseconds (exact integer arithmetic: sums do not drift)."""
    return (duration.days * 86_400 + duration.seconds) * _MICROS + duration.microseconds


class WaitHistogram(msgspec.Struct, kw_only=True):
    """Waits in ``WAIT_BUCKETS_SECONDS`` buckets; times in microseconds so that sums are exact."""

    bucket_counts: list[int] = msgspec.field(
        default_factory=lambda: [0] * (len(WAIT_BUCKETS_SECONDS) + 1)
    )
    """Per bucket, not cumulative; the last entry counts waits longer than the largest bound."""
    sum_micros: int = 0
    count: int = 0

    def observe(self, wait: timedelta) -> None:
        """Count one wait; a negative one (two writers' clocks disagree) counts as zero."""
        micros = max(0, _micros(wait))
        self.bucket_counts[bisect_left(_BOUNDS_MICROS, micros)] += 1
        self.sum_micros += micros
        self.count += 1

    @property
    def sum_seconds(self) -> float:
        return self.sum_micros / _MICROS

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, cumulative count)`` pairs, ending with ``+Inf``: the Prometheus histogram shape."""
        pairs: list[tuple[str, int]] = []
        running = 0
        for bound, count in zip(WAIT_BUCKETS_SECONDS, self.bucket_counts, strict=False):
            running += count
            pairs.append((str(float(bound)), running))
        pairs.append(("+Inf", self.count))
        return pairs


class NodeStatistics(msgspec.Struct, kw_only=True):
    """What the log says happened on one node, counted since the log began."""

    assignments: int = 0
    preemptions: dict[str, int] = msgspec.field(default_factory=dict)
    releases: dict[str, int] = msgspec.field(default_factory=dict)
    pod_rejections: dict[str, int] = msgspec.field(default_factory=dict)
    rejected_messages: int = 0
    waits: WaitHistogram = msgspec.field(default_factory=WaitHistogram)


def _count(table: dict[str, int], key: str) -> None:
    table[key] = table.get(key, 0) + 1


class LogStatistics(msgspec.Struct, kw_only=True):
    """Per-node counters folded from the log; register ``observe`` as a projection observer."""

    nodes: dict[str, NodeStatistics] = msgspec.field(default_factory=dict)

    def node(self, name: str) -> NodeStatistics:
        found = self.nodes.get(name)
        if found is None:
            found = self.nodes[name] = NodeStatistics()
        return found

    def copy(self) -> LogStatistics:
        """An independent deep copy (a snapshot must not change as the projection goes on)."""
        return _statistics_decoder.decode(_statistics_encoder.encode(self))

    @property
    def rejected_messages(self) -> int:
        return sum(stats.rejected_messages for stats in self.nodes.values())

    def observe(self, state: State, envelope: Envelope, seq: int) -> None:
        """Count one envelope, given the state before it is folded (the Projection observer signature)."""
        event = envelope.event
        handler = _HANDLERS.get(type(event))
        if handler is not None:
            handler(self, state, event, envelope.time)


def _end_wait(stats: LogStatistics, state: State, pod_ref: PodRef, at: datetime) -> None:
    pod = state.pods.get(pod_ref)
    if pod is not None and pod.phase == "ready" and pod.ready_since is not None:
        stats.node(pod.node).waits.observe(at - pod.ready_since)


def _on_assigned(stats: LogStatistics, state: State, event: Event, at: datetime) -> None:
    assert isinstance(event, Assigned)
    stats.node(event.node).assignments += 1
    _end_wait(stats, state, event.pod, at)


def _on_preempted(stats: LogStatistics, state: State, event: Event, at: datetime) -> None:
    assert isinstance(event, Preempted)
    _count(stats.node(event.node).preemptions, event.reason)


def _on_released(stats: LogStatistics, state: State, event: Event, at: datetime) -> None:
    assert isinstance(event, Released)
    _count(stats.node(event.node).releases, event.reason)
    _end_wait(stats, state, event.pod, at)


def _on_removed(stats: LogStatistics, state: State, event: Event, at: datetime) -> None:
    assert isinstance(event, PodRemoved)
    _end_wait(stats, state, event.pod, at)


def _on_registered(stats: LogStatistics, state: State, event: Event, at: datetime) -> None:
    """A registration replaces any earlier record of the pod, ending a wait it was in."""
    assert isinstance(event, PodRegistered)
    _end_wait(stats, state, event.pod, at)


def _on_pod_rejected(stats: LogStatistics, state: State, event: Event, at: datetime) -> None:
    assert isinstance(event, PodRejected)
    _count(stats.node(event.node).pod_rejections, event.reason)


def _on_message_rejected(stats: LogStatistics, state: State, event: Event, at: datetime) -> None:
    assert isinstance(event, MessageRejected)
    stats.node(event.node).rejected_messages += 1


_statistics_encoder = msgspec.msgpack.Encoder()
_statistics_decoder = msgspec.msgpack.Decoder(LogStatistics)

_Handler = Callable[[LogStatistics, State, Event, datetime], None]
_HANDLERS: dict[type, _Handler] = {
    Assigned: _on_assigned,
    Preempted: _on_preempted,
    Released: _on_released,
    PodRemoved: _on_removed,
    PodRegistered: _on_registered,
    PodRejected: _on_pod_rejected,
    MessageRejected: _on_message_rejected,
}
