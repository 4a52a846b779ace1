"""Poison entries in the log: each is refused with a specific reason, set aside once as a
MessageRejected, and never stops a service (or the fold behind ``gpupool verify``).

One test per entry the fault campaign of issue 12 found crash-looping every service:
a 2 KB entry nested 1,000 deep, a schema-1 entry with a share of ``"inf"``, a valid
event on another node's subject; and the range checks every decoded field gets.
"""

from __future__ import annotations

import json
import uuid

import pytest
from core_gwt import T0, node_events, ref, registered

from gpupool.cli.audit import verify
from gpupool.cli.commands.verify import render
from gpupool.core import RequestGpu, Schedule
from gpupool.eventlog import InMemoryEventLog
from gpupool.eventlog.port import StoredEvent, Undecodable, read_entries
from gpupool.eventlog.subjects import subject_for
from gpupool.events import (
    Assigned,
    Envelope,
    EventDecodeError,
    MessageRejected,
    PodReady,
    decode_entry,
    encode_envelope,
)
from gpupool.events.codec import EntryTooDeep, EntryTooLarge
from gpupool.events.limits import MAX_ENTRY_BYTES
from gpupool.runtime.decider import DeciderLoop

NESTED_1000 = (
    b'{"schema":2,"id":"x","time":"2025-04-22T08:00:00Z","event":'
    + b"[" * 1000
    + b"]" * 1000
    + b"}"
)
"""2 KB, nested 1,000 deep: msgspec raises RecursionError on it."""

SHARE_INF_V1 = json.dumps(
    {
        "schema": 1,
        "id": "poison-inf",
        "time": "2025-04-22T08:00:00Z",
        "event": {
            "type": "PodRegistered",
            "pod": {"namespace": "default", "name": "p"},
            "node": "n1",
            "policy": "share-pool",
            "requests": {"core": "inf", "memory": 0.5},
            "limits": {"core": 0.5, "memory": 0.5},
        },
    }
).encode()
"""A 270-byte schema-1 entry whose share upcasts to round(inf * 100): OverflowError."""


def assigned_json(gpu_index: int, *, node: str = "n1", pod: str = "a") -> bytes:
    return json.dumps(
        {
            "schema": 2,
            "id": uuid.uuid4().hex,
            "time": "2025-04-22T08:00:00Z",
            "event": {
                "type": "Assigned",
                "pod": {"namespace": "default", "name": pod},
                "node": node,
                "gpu_index": gpu_index,
                "gpu_uuid": "GPU-0",
            },
        }
    ).encode()


def test_an_entry_nested_1000_deep_is_refused_as_too_deep_not_a_recursion_error() -> None:
    assert len(NESTED_1000) < 2100
    with pytest.raises(EntryTooDeep, match="nested deeper"):
        decode_entry(NESTED_1000)
    schema_1 = NESTED_1000.replace(b'"schema":2', b'"schema":1')
    with pytest.raises(EntryTooDeep):
        decode_entry(schema_1)


def test_a_schema_1_share_of_inf_is_refused_not_an_overflow() -> None:
    assert len(SHARE_INF_V1) < 300
    with pytest.raises(EventDecodeError, match="cannot upcast"):
        decode_entry(SHARE_INF_V1)
    nan = SHARE_INF_V1.replace(b'"inf"', b'"nan"')
    with pytest.raises(EventDecodeError):
        decode_entry(nan)
    huge = SHARE_INF_V1.replace(b'"inf"', b"1e300")
    with pytest.raises(EventDecodeError, match="core"):
        decode_entry(huge)


def test_an_entry_larger_than_the_limit_is_refused_before_it_is_parsed() -> None:
    data = b'{"schema":2,"pad":"' + b"x" * MAX_ENTRY_BYTES + b'"}'
    with pytest.raises(EntryTooLarge, match="larger than the limit"):
        decode_entry(data)


@pytest.mark.parametrize(
    ("gpu_index", "fits"), [(0, True), (1023, True), (-1, False), (1024, False), (2**70, False)]
)
def test_a_gpu_index_out_of_range_is_refused_with_the_field(gpu_index: int, fits: bool) -> None:
    if fits:
        (envelope,) = decode_entry(assigned_json(gpu_index))
        assert isinstance(envelope.event, Assigned)
    else:
        with pytest.raises(EventDecodeError, match="gpu_index"):
            decode_entry(assigned_json(gpu_index))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("priority", 2**40),
        ("node", "n" * 254),
        ("requests", {"core": 101, "memory": 50}),
        ("limits", {"core": 50, "memory": -1}),
    ],
)
def test_a_registered_pod_out_of_range_is_refused(field: str, value: object) -> None:
    event: dict[str, object] = {
        "type": "PodRegistered",
        "pod": {"namespace": "default", "name": "p"},
        "node": "n1",
        "policy": "share-pool",
        "requests": {"core": 50, "memory": 50},
        "limits": {"core": 50, "memory": 50},
    }
    event[field] = value
    data = json.dumps({"schema": 2, "id": "x", "time": "2025-04-22T08:00:00Z", "event": event})
    with pytest.raises(EventDecodeError, match=field):
        decode_entry(data.encode())


def test_a_duration_past_the_calendar_is_refused_in_a_logged_node_configuration() -> None:
    data = json.dumps(
        {
            "schema": 2,
            "id": "x",
            "time": "2025-04-22T08:00:00Z",
            "event": {
                "type": "NodeConfigured",
                "node": "n1",
                "policy": "share-pool",
                "qos": {"preempt_enabled": True, "pod_max_duration_minutes": 10**10},
            },
        }
    )
    with pytest.raises(EventDecodeError, match="pod_max_duration_minutes"):
        decode_entry(data.encode())


def test_an_event_on_another_nodes_subject_is_not_believed() -> None:
    envelope = Envelope(id="x", time=T0, event=PodReady(pod=ref("a"), node="n1"))
    right = subject_for(envelope.event, prefix="gpupool.log")
    (entry,) = read_entries(5, right, encode_envelope(envelope))
    assert isinstance(entry, StoredEvent)
    (entry,) = read_entries(5, "gpupool.log.n2.PodReady", encode_envelope(envelope))
    assert isinstance(entry, Undecodable)
    assert "names node 'n2'" in entry.error and "for node 'n1'" in entry.error
    (entry,) = read_entries(5, "gpupool.log._.PodReady", encode_envelope(envelope))
    assert isinstance(entry, Undecodable)


def envelope(event: object) -> Envelope:
    return Envelope(id=uuid.uuid4().hex, time=T0, event=event)  # type: ignore[arg-type]


async def test_poison_entries_are_set_aside_once_and_every_node_is_still_decided(
    memory_log: InMemoryEventLog,
) -> None:
    for event in [*node_events(1, node="n1"), *node_events(1, node="n2")]:
        await memory_log.append(envelope(event))
    await memory_log.append(envelope(registered("a", 50, node="n1")))
    await memory_log.append(envelope(registered("b", 50, node="n2")))
    # a valid event of n1 on n2's subject: n2's last sequence moves, n2's state does not
    misplaced = encode_envelope(envelope(PodReady(pod=ref("a"), node="n1")))
    poison = {
        await memory_log.append_raw("gpupool.log.n1.Assigned", NESTED_1000): "nested deeper",
        await memory_log.append_raw("gpupool.log.n1.PodRegistered", SHARE_INF_V1): "upcast",
        await memory_log.append_raw("gpupool.log.n2.PodReady", misplaced): "names node 'n2'",
        await memory_log.append_raw("gpupool.log.n1.Assigned", assigned_json(2**70)): "gpu_index",
    }

    executor = DeciderLoop(memory_log, service="node-executor")
    await executor.rebuild()
    for node, pod in (("n1", "a"), ("n2", "b")):
        await executor.execute(RequestGpu(pod=ref(pod), node=node), node=node)
    admission = DeciderLoop(memory_log, service="admission-queue")
    await admission.rebuild()  # sees the executor's rejections: records none again
    for node in ("n1", "n2"):
        events = await admission.execute(Schedule(node=node), node=node)
        assert [type(e) for e in events] == [Assigned], node

    rejections: dict[int, str] = {}
    async for entry in memory_log.replay():
        if isinstance(entry, StoredEvent) and isinstance(entry.envelope.event, MessageRejected):
            rejected = entry.envelope.event
            assert rejected.seq not in rejections, "a poison entry was set aside twice"
            rejections[rejected.seq] = rejected.reason
    assert sorted(rejections) == sorted(poison)
    for seq, words in poison.items():
        assert words in rejections[seq]
    assert admission.conflicts == 0
    assert admission.projection.state.pods[ref("b")].phase == "running"


def test_verify_reads_a_log_of_poison_to_its_end_and_lists_each_entry_set_aside() -> None:
    good = [
        envelope(event) for event in [*node_events(1, node="n1"), registered("a", 50, node="n1")]
    ]
    entries = [
        entry
        for seq, (subject, data) in enumerate(
            [
                *((subject_for(e.event, prefix="gpupool.log"), encode_envelope(e)) for e in good),
                ("gpupool.log.n1.Assigned", NESTED_1000),
                ("gpupool.log.n1.PodRegistered", SHARE_INF_V1),
                (
                    "gpupool.log.n2.PodReady",
                    encode_envelope(envelope(PodReady(pod=ref("a"), node="n1"))),
                ),
                ("gpupool.log.n1.Assigned", assigned_json(2**70)),
                ("gpupool.log.n1.Assigned", assigned_json(0, pod="ghost")),  # valid; no such pod
            ],
            start=1,
        )
        for entry in read_entries(seq, subject, data)
    ]
    report = verify(entries)
    first = len(good) + 1
    assert [entry.seq for entry in report.set_aside] == list(range(first, first + 5))
    reasons = [entry.reason for entry in report.set_aside]
    for words, reason in zip(
        ["nested deeper", "cannot upcast", "names node 'n2'", "gpu_index", "UnknownPod"],
        reasons,
        strict=True,
    ):
        assert words in reason
    assert report.undecodable == 4
    assert f"set aside #{first + 4}: UnknownPod" in "\n".join(render(report))
