"""Archived segments: sealed, hash-chained, byte-exact; a gap, a changed file or a rewritten
manifest is a specific error; the purge rule; checkpoints fold to what a fold from zero gives.

The stream side (export from a real nats-server, purge, services restarting) is in
tests/integration/test_eventlog_retention.py."""

from __future__ import annotations

import hashlib
import itertools
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import pytest
import yaml

from gpupool.core.simulation import Scenario, simulate
from gpupool.eventlog.archive import (
    Archive,
    ArchiveError,
    ArchiveGap,
    ChainBroken,
    PurgeRefused,
    ReaderStart,
    SegmentTampered,
    check_purge,
    manifest_name,
    segment_name,
)
from gpupool.eventlog.reader import RawMessage
from gpupool.eventlog.subjects import subject_for
from gpupool.events import encode_envelope
from gpupool.runtime.checkpoint import archive_checkpointer, fold_messages, projection_at
from gpupool.runtime.projection import metrics_projection
from gpupool.runtime.snapshot import decode_snapshot

ROOT = Path(__file__).resolve().parents[2]
STREAM = "GPUPOOL"


def worked_example_messages() -> list[RawMessage]:
    """The worked example as stream messages, with an unreadable entry in the middle."""
    scenario = msgspec.convert(
        yaml.safe_load((ROOT / "scenarios" / "worked-example.yaml").read_text()), Scenario
    )
    envelopes = simulate(scenario)
    time = datetime(2026, 1, 1, tzinfo=UTC)
    messages = [
        RawMessage(
            seq=0,
            subject=subject_for(envelope.event, writer="policy"),
            data=encode_envelope(envelope),
            headers={"Nats-Msg-Id": envelope.id},
            time=time,
        )
        for envelope in envelopes
    ]
    garbage = RawMessage(
        seq=0, subject="gpupool.log._.policy", data=b"\xff\x00{not json", time=time
    )
    messages.insert(7, garbage)
    return [msgspec.structs.replace(m, seq=i) for i, m in enumerate(messages, start=1)]


MESSAGES = worked_example_messages()


def archived(directory: Path, ends: list[int], *, checkpoints: bool = True) -> Archive:
    """An archive of MESSAGES cut into segments ending at ``ends``."""
    archive = Archive(directory)
    start = archive_checkpointer(archive)([])
    previous = None
    first = 1
    for last in ends:
        batch = MESSAGES[first - 1 : last]
        previous = archive.seal(
            batch,
            stream=STREAM,
            previous=previous,
            checkpoint=start(batch) if checkpoints else None,
        )
        first = last + 1
    return archive


def test_sealed_segments_read_back_every_entry_byte_for_byte(tmp_path: Path) -> None:
    archive = archived(tmp_path, [4, 8, 12, len(MESSAGES)])
    assert list(archive.messages()) == MESSAGES
    sealed = archive.sealed()
    assert [(s.manifest.first_seq, s.manifest.last_seq) for s in sealed] == [
        (1, 4),
        (5, 8),
        (9, 12),
        (13, len(MESSAGES)),
    ]
    for before, after in itertools.pairwise(sealed):
        raw = tmp_path / manifest_name(before.manifest.first_seq, before.manifest.last_seq)
        assert (
            after.manifest.previous_manifest_sha256 == hashlib.sha256(raw.read_bytes()).hexdigest()
        )
    assert sealed[0].manifest.previous_manifest_sha256 == ""
    assert archive.last_seq == len(MESSAGES)
    unreadable = [e for e in archive.entries() if not hasattr(e, "envelope")]
    assert [e.seq for e in unreadable] == [8]


def test_a_changed_segment_is_refused_naming_the_file(tmp_path: Path) -> None:
    archive = archived(tmp_path, [4, 8, len(MESSAGES)])
    path = tmp_path / segment_name(5, 8)
    data = bytearray(path.read_bytes())
    data[40] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(SegmentTampered, match=rf"{segment_name(5, 8)}: its sha256 is .* sealed"):
        archive.sealed()


def test_a_missing_segment_is_a_gap_naming_the_missing_entries(tmp_path: Path) -> None:
    archive = archived(tmp_path, [4, 8, len(MESSAGES)])
    (tmp_path / segment_name(5, 8)).unlink()
    (tmp_path / manifest_name(5, 8)).unlink()
    with pytest.raises(ArchiveGap, match=r"starts at sequence 9, but .* ends at 4: entries 5..8"):
        archive.sealed()
    (tmp_path / segment_name(1, 4)).unlink()
    with pytest.raises(ArchiveGap, match=rf"{segment_name(1, 4)} is missing"):
        archive.sealed()


def test_a_segment_rewritten_with_its_manifest_breaks_the_next_link(tmp_path: Path) -> None:
    archive = archived(tmp_path, [4, 8, len(MESSAGES)], checkpoints=False)
    # rewrite segment 5..8 with other bytes and seal it again, consistently with itself
    forged_messages = [msgspec.structs.replace(m, data=b"forged") for m in MESSAGES[4:8]]
    first = archive.sealed()[0]
    (tmp_path / manifest_name(5, 8)).unlink()
    archive.seal(forged_messages, stream=STREAM, previous=first)
    with pytest.raises(
        ChainBroken, match=rf"{manifest_name(9, len(MESSAGES))} links to .* rewritten"
    ):
        archive.sealed()


def test_a_segment_without_its_manifest_is_not_part_of_the_archive(tmp_path: Path) -> None:
    archive = archived(tmp_path, [4])
    (tmp_path / segment_name(5, 8)).write_bytes(b'{"seq": 5, "subj')  # a crash mid-write
    (tmp_path / ".segment-x.tmp").write_bytes(b"partial")
    assert archive.last_seq == 4
    removed = archive.remove_unsealed(archive.sealed())
    assert sorted(p.name for p in removed) == [".segment-x.tmp", segment_name(5, 8)]
    assert archive.last_seq == 4 and list(archive.messages()) == MESSAGES[:4]


def test_a_checkpoint_folds_to_what_folding_from_zero_gives(tmp_path: Path) -> None:
    archive = archived(tmp_path, [4, 8, 12, len(MESSAGES)])
    whole = metrics_projection()
    fold_messages(whole, MESSAGES)
    seq, data = archive.latest_checkpoint() or (0, b"")
    assert seq == len(MESSAGES)
    assert decode_snapshot(data) == whole.to_snapshot()
    # resuming from the checkpoint of 1..8 and folding the rest
    resumed = projection_at(archive, archive.sealed()[:2])
    assert resumed.last_seq == 8
    fold_messages(resumed, MESSAGES[8:])
    assert resumed.to_snapshot() == whole.to_snapshot()


def purge(up_to: int, **changes: object) -> int:
    arguments: dict[str, object] = {
        "archive_last": 12,
        "checkpoints": [4, 8, 12],
        "stream_first": 1,
        "stream_last": 15,
        "durables": ["policy-a", "admission-queue-a"],
        "snapshots": [ReaderStart("policy-a", 13), ReaderStart("admission-queue-a", 15)],
    }
    arguments.update(changes)
    return check_purge(up_to, **arguments)  # type: ignore[arg-type]


def test_a_purge_every_reader_can_start_past_is_allowed() -> None:
    assert purge(12) == 12
    assert purge(8, stream_first=5) == 4


@pytest.mark.parametrize(
    ("up_to", "changes", "reason"),
    [
        (13, {}, r"archive ends at sequence 12: entries 13..13 are not archived"),
        (
            10,
            {},
            r"10 does not end an archived segment with a checkpoint \(the last ones: 4, 8, 12\)",
        ),
        (16, {}, r"stream ends at sequence 15"),
        (4, {"stream_first": 9}, r"starts at sequence 9: everything up to 4 is gone"),
        (
            12,
            {"snapshots": [ReaderStart("policy-a", 13)]},
            r"no snapshot given for the durable consumer\(s\) admission-queue-a",
        ),
        (
            12,
            {"snapshots": [ReaderStart("policy-a", 9), ReaderStart("admission-queue-a", 15)]},
            r"policy-a's snapshot covers only up to 9; the safe bound is 9",
        ),
        (
            12,
            {"snapshots": [ReaderStart("policy-a", 13), ReaderStart("admission-queue-a", 99)]},
            r"admission-queue-a covers sequence 99, past the stream's last 15",
        ),
    ],
)
def test_a_purge_past_what_a_reader_can_start_from_is_refused_saying_why(
    up_to: int, changes: dict[str, object], reason: str
) -> None:
    with pytest.raises(PurgeRefused, match=reason):
        purge(up_to, **changes)


def test_one_writer_at_a_time_holds_the_archive(tmp_path: Path) -> None:
    archive = Archive(tmp_path)
    with (
        archive.locked(),
        pytest.raises(ArchiveError, match="another `gpupool log archive`"),
        Archive(tmp_path).locked(),
    ):
        pass
    with archive.locked():  # released: taken again
        pass


def test_a_claimed_durable_slot_stands_for_the_service_instance_named_in_its_metadata() -> None:
    from gpupool.eventlog.archive import durable_reader

    assert durable_reader("admission-queue-3", "aq-7f9c") == "admission-queue-aq-7f9c"
    assert durable_reader("node-executor-gpu-node-1-0", "ex-1") == "node-executor-ex-1"
    assert durable_reader("policy-0", "0") == "policy-0"
    assert durable_reader("old-style-durable", None) == "old-style-durable"
