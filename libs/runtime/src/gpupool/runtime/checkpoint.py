"""Checkpoints of the fold at an archive's cut: a projection snapshot of the archived log.

``gpupool log archive`` folds each new segment into a projection (resumed from the
archive's newest checkpoint) and seals the snapshot at the segment's end beside it
(:mod:`gpupool.eventlog.archive`). The bytes are an ordinary projection snapshot
(:mod:`gpupool.runtime.snapshot`, with the metrics' statistics), so a service that has
no snapshot past a purge starts from a copy of it: put it at
``<snapshot-dir>/<service>-<instance>.snapshot`` and the service resumes after the
cut (``load_projection``), exactly as if it had folded the purged entries itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from gpupool.eventlog.archive import Archive, Checkpointer, Sealed
from gpupool.eventlog.port import Entry, StoredEvent, read_entries
from gpupool.eventlog.reader import RawMessage
from gpupool.eventlog.subjects import node_of_subject, writer_of_subject
from gpupool.runtime.projection import Projection, metrics_projection
from gpupool.runtime.snapshot import decode_snapshot, encode_snapshot


def fold_entry(projection: Projection, entry: Entry) -> bool:
    """Fold one entry as a service's rebuild does (``DeciderLoop.fold``); False if seen before."""
    if isinstance(entry, StoredEvent):
        new = projection.apply(
            entry.seq,
            entry.envelope,
            index=entry.index,
            last=entry.last,
            writer=writer_of_subject(entry.subject),
        )
        projection.take_refused()  # the services recorded their MessageRejected in the log
        return new
    return projection.skip(
        entry.seq, node_of_subject(entry.subject), writer_of_subject(entry.subject)
    )


def fold_messages(projection: Projection, messages: Iterable[RawMessage]) -> None:
    for message in messages:
        for entry in read_entries(message.seq, message.subject, message.data):
            fold_entry(projection, entry)


def projection_at(archive: Archive, sealed: Sequence[Sealed]) -> Projection:
    """The fold of the archive's sealed segments: from its newest checkpoint and the
    segments after it (each segment normally has one: nothing is folded again)."""
    latest = archive.latest_checkpoint(sealed)
    if latest is None:
        projection = metrics_projection()
        rest = list(sealed)
    else:
        seq, data = latest
        projection = Projection.from_snapshot(decode_snapshot(data))
        rest = [s for s in sealed if s.manifest.first_seq > seq]
    fold_messages(projection, archive.messages(rest))
    return projection


def archive_checkpointer(archive: Archive) -> Callable[[Sequence[Sealed]], Checkpointer]:
    """For ``archive_stream(checkpointer=...)``: folds each new segment after the archive's
    sealed ones and returns the snapshot at its end."""

    def start(sealed: Sequence[Sealed]) -> Checkpointer:
        projection = projection_at(archive, sealed)

        def checkpoint(messages: Sequence[RawMessage]) -> bytes:
            fold_messages(projection, messages)
            return encode_snapshot(projection.to_snapshot())

        return checkpoint

    return start
