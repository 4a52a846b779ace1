"""Snapshots: resume from sequence k and fold the rest == fold everything from zero."""

from __future__ import annotations

import dataclasses
import os
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import pytest
from observability_logs import LogEntry, exposition, fold, random_log

from gpupool.core import NodeState, PodState, State
from gpupool.core.state import NODE_INDEXES
from gpupool.events import Envelope, PodReady, PodRef
from gpupool.observability import (
    SNAPSHOT_FORMAT,
    FileSnapshotStore,
    Projection,
    SnapshotFormatError,
    decode_snapshot,
    encode_snapshot,
    load_projection,
    metrics_projection,
    metrics_registry,
    save_projection,
)
from gpupool.runtime.snapshot import NodeRecord, PodRecord, StateRecord


@pytest.fixture(scope="module")
def log() -> list[LogEntry]:
    return random_log(11, pods_per_node=12, actions_per_pod=60)


@pytest.fixture(scope="module")
def from_zero(log: list[LogEntry]) -> Projection:
    return fold(log, metrics_projection())


def assert_same(resumed: Projection, expected: Projection) -> None:
    assert resumed.state == expected.state
    assert resumed.statistics == expected.statistics
    assert (resumed.last_seq, resumed.node_seq, resumed.undecodable) == (
        expected.last_seq,
        expected.node_seq,
        expected.undecodable,
    )
    assert exposition(metrics_registry(resumed)) == exposition(metrics_registry(expected))


def test_the_log_is_long_and_varied(log: list[LogEntry]) -> None:
    kinds = {type(envelope.event).__name__ for _, envelope, _ in log if envelope is not None}
    assert len(log) > 2500
    assert {"Preempted", "PodRemoved", "NodeDisabled", "MessageRejected", "PodRejected"} <= kinds
    assert any(envelope is None for _, envelope, _ in log)


def test_resuming_from_a_snapshot_at_any_point_gives_the_fold_from_zero(
    log: list[LogEntry], from_zero: Projection
) -> None:
    for k in [0, 1, 7, *range(50, len(log), 173), len(log) - 1, len(log)]:
        head = fold(log[:k], metrics_projection())
        data = encode_snapshot(head.to_snapshot())

        resumed = fold(log[k:], Projection.from_snapshot(decode_snapshot(data)))

        assert resumed.last_seq == log[-1][0], k
        assert_same(resumed, from_zero)


def test_entries_already_covered_by_the_snapshot_are_not_applied_again(
    log: list[LogEntry], from_zero: Projection
) -> None:
    k = len(log) // 2
    resumed = Projection.from_snapshot(
        decode_snapshot(encode_snapshot(fold(log[:k], metrics_projection()).to_snapshot()))
    )

    fold(log, resumed)  # the whole log again: a consumer that restarted from the beginning

    assert_same(resumed, from_zero)


def node_of(entry: LogEntry) -> str | None:
    _, envelope, node = entry
    return node if envelope is None else envelope.event.node


def test_a_snapshot_keeps_the_entries_applied_ahead_of_the_watermark(
    log: list[LogEntry], from_zero: Projection
) -> None:
    """A decider folds its own entry before lower sequences of other nodes have arrived."""
    k = next(
        i
        for i in range(len(log) // 2, len(log) - 2)
        if log[i + 2][1] is not None
        and node_of(log[i + 2]) not in (node_of(log[i]), node_of(log[i + 1]))
    )
    head = fold(log[:k], metrics_projection())
    fold([log[k + 2]], head)
    assert head.ahead == {log[k + 2][0]}
    node = node_of(log[k + 2])
    assert node is not None and head.node_seq.get(node, 0) < log[k + 2][0]  # awaits the watermark

    resumed = Projection.from_snapshot(decode_snapshot(encode_snapshot(head.to_snapshot())))
    fold(log[k : k + 2], resumed)
    assert resumed.node_seq[node] == log[k + 2][0]  # the watermark passed it: the node's moves
    fold(log[k:], resumed)

    assert resumed.ahead == set()
    assert_same(resumed, from_zero)


def test_a_snapshot_does_not_change_as_the_projection_goes_on(log: list[LogEntry]) -> None:
    projection = fold(log[:1000], metrics_projection())
    snapshot = projection.to_snapshot()
    before = encode_snapshot(snapshot)

    fold(log[1000:], projection)

    assert encode_snapshot(snapshot) == before
    restored = Projection.from_snapshot(snapshot)
    fold(log[1000:1200], restored)
    assert encode_snapshot(snapshot) == before


def test_a_projection_without_statistics_snapshots_without_them(
    log: list[LogEntry], from_zero: Projection
) -> None:
    plain = fold(log, Projection())

    restored = Projection.from_snapshot(decode_snapshot(encode_snapshot(plain.to_snapshot())))

    assert restored.statistics is None
    assert restored.state == from_zero.state


def test_the_conversion_covers_every_field_of_the_core_state() -> None:
    """A field added to State, NodeState or PodState must be added to the snapshot records
    (the node indexes evolve keeps are computed again on restore, not stored)."""
    for dataclass, record in ((State, StateRecord), (NodeState, NodeRecord), (PodState, PodRecord)):
        fields = [
            field.name for field in dataclasses.fields(dataclass) if field.name not in NODE_INDEXES
        ]
        assert fields == list(record.__struct_fields__), dataclass.__name__


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"\x93\x01\x02", id="not-a-map"),
        pytest.param(msgspec.msgpack.encode({"format": SNAPSHOT_FORMAT + 1}), id="newer-format"),
        pytest.param(msgspec.msgpack.encode({"format": SNAPSHOT_FORMAT}), id="missing-fields"),
    ],
)
def test_an_unreadable_snapshot_is_refused(data: bytes) -> None:
    with pytest.raises(SnapshotFormatError):
        decode_snapshot(data)


# --------------------------------------------------------------------------- the file store


async def test_the_file_store_resumes_where_the_snapshot_was_taken(
    tmp_path: Path, log: list[LogEntry], from_zero: Projection
) -> None:
    store = FileSnapshotStore(tmp_path / "queue" / "projection.snapshot")
    k = 2 * len(log) // 3
    covered = await save_projection(store, fold(log[:k], metrics_projection()))

    projection, why = await load_projection(store)

    assert covered == log[k - 1][0]
    assert projection.last_seq == covered
    assert why == f"resuming after sequence {covered} from the snapshot"
    assert_same(fold(log[k:], projection), from_zero)
    assert os.listdir(tmp_path / "queue") == ["projection.snapshot"]


async def test_without_a_snapshot_the_projection_is_rebuilt_from_zero(tmp_path: Path) -> None:
    projection, why = await load_projection(FileSnapshotStore(tmp_path / "none"))

    assert projection.last_seq == 0
    assert projection.statistics is not None
    assert "no snapshot" in why


async def test_a_damaged_snapshot_is_set_aside(tmp_path: Path) -> None:
    path = tmp_path / "projection.snapshot"
    path.write_bytes(b"\x00garbage")

    projection, why = await load_projection(FileSnapshotStore(path))

    assert projection.last_seq == 0
    assert "set aside" in why


async def test_a_snapshot_without_statistics_is_not_used_for_metrics(
    tmp_path: Path, log: list[LogEntry]
) -> None:
    store = FileSnapshotStore(tmp_path / "projection.snapshot")
    await save_projection(store, fold(log[:100], Projection()))

    for_metrics, why = await load_projection(store)
    plain, _ = await load_projection(store, empty=Projection)

    assert for_metrics.last_seq == 0
    assert "no statistics" in why
    assert plain.last_seq == log[99][0]


async def test_a_failed_write_leaves_the_previous_snapshot_whole(
    tmp_path: Path, log: list[LogEntry], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FileSnapshotStore(tmp_path / "projection.snapshot")
    first = await save_projection(store, fold(log[:100], metrics_projection()))

    def failing_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="No space left"):
        await save_projection(store, fold(log[:500], metrics_projection()))
    monkeypatch.undo()

    projection, _ = await load_projection(store)
    assert projection.last_seq == first
    assert os.listdir(tmp_path) == ["projection.snapshot"]


def test_a_snapshot_taken_inside_a_decision_entry_resumes_after_its_folded_part() -> None:
    pod = PodRef(namespace="default", name="a")
    parts = [
        Envelope(
            id=f"part-{i}", time=datetime(2025, 1, 1, tzinfo=UTC), event=PodReady(pod=pod, node="n")
        )
        for i in range(2)
    ]
    projection = Projection()
    assert projection.apply(1, parts[0], index=0, last=False)
    resumed = Projection.from_snapshot(decode_snapshot(encode_snapshot(projection.to_snapshot())))
    assert not resumed.apply(1, parts[0], index=0, last=False)  # folded already: not again
    assert resumed.apply(1, parts[1], index=1, last=True)
    assert resumed.last_seq == 1
