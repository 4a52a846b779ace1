"""Envelopes, events and stored entries are not tracked by the cyclic garbage collector
(``gc=False`` structs: frozen, holding no containers that could close a cycle), decoded
or made here; the rebuilt state is frozen out of later collections after a rebuild."""

from __future__ import annotations

import gc
from datetime import UTC, datetime

from gpupool.eventlog.port import read_entries
from gpupool.events import (
    ALL_EVENT_TYPES,
    Assigned,
    Envelope,
    GpuInfo,
    GpuInventoryReported,
    PodRef,
    encode_entry,
)
from gpupool.events.codec import LogEntry
from gpupool.runtime.heap import settle_after_rebuild

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_every_event_type_and_the_envelope_are_untracked_structs() -> None:
    for struct in (*ALL_EVENT_TYPES, Envelope, LogEntry, PodRef, GpuInfo):
        assert struct.__struct_config__.gc is False, struct  # type: ignore[attr-defined]


def test_a_decoded_decision_entry_is_not_tracked_by_the_collector() -> None:
    pod = PodRef(namespace="ns", name="a")
    envelopes = [
        Envelope(
            id="1",
            time=T0,
            event=GpuInventoryReported(
                node="n",
                gpus=(GpuInfo(index=0, uuid="G", memory_mib=1),),
                source="nvml",
            ),
        ),
        Envelope(id="2", time=T0, event=Assigned(pod=pod, node="n", gpu_index=0, gpu_uuid="G")),
    ]
    entries = read_entries(7, "gpupool.log.n.admission-queue", encode_entry(envelopes))
    assert [entry.envelope for entry in entries] == envelopes  # type: ignore[union-attr]
    for entry in entries:
        assert not gc.is_tracked(entry)
        assert not gc.is_tracked(entry.envelope)  # type: ignore[union-attr]
        assert not gc.is_tracked(entry.envelope.event)  # type: ignore[union-attr]


def test_settling_after_a_rebuild_freezes_what_is_left() -> None:
    kept = {"state": [object()]}
    try:
        settle_after_rebuild()
        assert gc.get_freeze_count() > 0
        assert gc.is_tracked(kept)
        assert all(tracked is not kept for tracked in gc.get_objects())  # frozen: none of them
    finally:
        gc.unfreeze()
