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
from datetime import datetime, timedelta

import msgspec

from gpupool.core import State, assignment_holds
from gpupool.events import (
    ALL_EVENT_TYPES,
    Assigned,
    Envelope,
    MessageRejected,
    PodReady,
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


_MICROSECOND = timedelta(microseconds=1)


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
        micros = wait // _MICROSECOND
        if micros < 0:
            micros = 0
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

    def observe(
        self, state: State, envelope: Envelope, seq: int, holds: bool | None = None
    ) -> None:
        """Count one envelope, given the state before it is folded (the Projection observer signature).

        Dispatch is by exact type, most frequent first: this runs for every entry of a rebuild.
        ``holds``: for an Assigned, ``assignment_holds`` on this state if the caller has it.
        """
        event = envelope.event
        if type(event) is PodReady:
            return
        if type(event) is Assigned:
            if not (assignment_holds(state, event) if holds is None else holds):
                return  # folded as a no-op (its pod left the queue first): nothing assigned
            nodes = self.nodes
            stats = nodes.get(event.node) or self.node(event.node)
            stats.assignments += 1
            # _end_wait inlined (an Assigned that holds ends a wait nearly always)
            pod = state.pods.get(event.pod)
            if pod is not None and pod.ready_since is not None and pod.phase == "ready":
                if pod.node != event.node:
                    stats = nodes.get(pod.node) or self.node(pod.node)
                stats.waits.observe(envelope.time - pod.ready_since)
        elif type(event) is Released:
            stats = self.nodes.get(event.node) or self.node(event.node)
            releases = stats.releases
            reason = event.reason
            releases[reason] = releases.get(reason, 0) + 1
            self._end_wait(state, event.pod, envelope.time)
        elif type(event) is PodRejected:
            stats = self.nodes.get(event.node) or self.node(event.node)
            rejections = stats.pod_rejections
            rejected = event.reason
            rejections[rejected] = rejections.get(rejected, 0) + 1
        elif type(event) is Preempted:
            _count(self.node(event.node).preemptions, event.reason)
        elif type(event) is PodRemoved or type(event) is PodRegistered:
            # A registration replaces any earlier record of the pod, ending a wait it was in.
            self._end_wait(state, event.pod, envelope.time)
        elif type(event) is MessageRejected:
            self.node(event.node).rejected_messages += 1

    def _end_wait(self, state: State, pod_ref: PodRef, at: datetime) -> None:
        pod = state.pods.get(pod_ref)
        if pod is not None and pod.ready_since is not None and pod.phase == "ready":
            stats = self.nodes.get(pod.node) or self.node(pod.node)
            stats.waits.observe(at - pod.ready_since)


_COUNTED_EVENTS = {Assigned, Released, PodRejected, Preempted, PodRemoved, PodRegistered}
UNCOUNTED_EVENTS: frozenset[type] = frozenset(ALL_EVENT_TYPES) - _COUNTED_EVENTS - {MessageRejected}
"""Event types ``LogStatistics.observe`` counts nothing for: a projection need not call it."""


def _count(table: dict[str, int], key: str) -> None:
    table[key] = table.get(key, 0) + 1


_statistics_encoder = msgspec.msgpack.Encoder()
_statistics_decoder = msgspec.msgpack.Decoder(LogStatistics)
