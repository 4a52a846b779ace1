"""Preemptions with both sides: the victim (priority, how long it had held the GPU, when it
let go) and the preemptor (priority, how long it had waited, where it then ran)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

import msgspec

from gpupool.eventlog.port import Entry, StoredEvent, Undecodable
from gpupool.eventlog.subjects import writer_of_subject
from gpupool.events import Assigned, PodRef, Preempted, Released
from gpupool.runtime.projection import Projection


class PreemptionRecord(msgspec.Struct, frozen=True, kw_only=True):
    seq: int
    time: datetime
    node: str
    gpu_index: int
    reason: str
    victim: PodRef
    victim_priority: int
    victim_held: timedelta | None
    """How long the victim had held its GPU when it was preempted."""
    preemptor: PodRef
    preemptor_priority: int
    preemptor_waited: timedelta | None
    """How long the preemptor had waited in the ready queue when it preempted."""
    victim_released_at: datetime | None = None
    preemptor_assigned_at: datetime | None = None
    preemptor_gpu: int | None = None


def preemptions(entries: Sequence[Entry], *, node: str | None = None) -> list[PreemptionRecord]:
    projection = Projection()
    records: list[PreemptionRecord] = []
    for entry in entries:
        if isinstance(entry, Undecodable):
            projection.skip(entry.seq, None)
            continue
        assert isinstance(entry, StoredEvent)
        envelope = entry.envelope
        event = envelope.event
        state = projection.state
        now = envelope.time
        if isinstance(event, Preempted) and (node is None or event.node == node):
            victim = state.pods.get(event.victim)
            preemptor = state.pods.get(event.preemptor)
            records.append(
                PreemptionRecord(
                    seq=entry.seq,
                    time=now,
                    node=event.node,
                    gpu_index=event.gpu_index,
                    reason=event.reason,
                    victim=event.victim,
                    victim_priority=victim.priority if victim else 0,
                    victim_held=now - victim.running_since
                    if victim and victim.running_since
                    else None,
                    preemptor=event.preemptor,
                    preemptor_priority=preemptor.priority if preemptor else 0,
                    preemptor_waited=now - preemptor.ready_since
                    if preemptor and preemptor.ready_since
                    else None,
                )
            )
        elif isinstance(event, Released) and event.gpu_index is not None:
            for index, record in enumerate(records):
                if record.victim == event.pod and record.victim_released_at is None:
                    records[index] = msgspec.structs.replace(record, victim_released_at=now)
        elif isinstance(event, Assigned):
            for index, record in enumerate(records):
                if record.preemptor == event.pod and record.preemptor_assigned_at is None:
                    records[index] = msgspec.structs.replace(
                        record, preemptor_assigned_at=now, preemptor_gpu=event.gpu_index
                    )
        projection.apply(
            entry.seq,
            envelope,
            index=entry.index,
            last=entry.last,
            writer=writer_of_subject(entry.subject),
        )
    return records
