"""Golden samples of every event, the v1 upcaster, loud failures, and the checked-in JSON Schema.

tests/golden/events/<Tag>.json holds one full envelope per event type at the current
schema; tests/golden/events/v1/ holds envelopes as version 1 wrote them. They are
fixed files: if the code can no longer read them, an old log can no longer be read.
"""

from __future__ import annotations

import importlib.util
import json
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType

import msgspec
import pytest

from gpupool.events import (
    ALL_EVENT_TYPES,
    NODELESS,
    SCHEMA_VERSION,
    Assigned,
    Envelope,
    Event,
    EventDecodeError,
    GpuInfo,
    GpuInventoryReported,
    MessageRejected,
    NodeConfigured,
    NodeDisabled,
    NodeRejected,
    PodReady,
    PodRef,
    PodRegistered,
    PodRejected,
    PodRemoved,
    Preempted,
    QosConfig,
    Released,
    Share,
    UnknownSchemaVersion,
    decode_envelope,
    encode_envelope,
    event_json_schema,
    event_tag,
)

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "events"
NODE = "cn-wulanchabu-c.cr-xxx"
DEMO = PodRef(namespace="default", name="gpu-share-demo")
OLD = PodRef(namespace="default", name="gpu-share-old")
TIME = datetime(2025, 4, 22, 8, 12, 9, tzinfo=UTC)
UUID = "GPU-3f9c1f2e-5b7a-4c1d-9e8f-0a1b2c3d4e5f"

EXPECTED: dict[str, Event] = {
    "NodeConfigured": NodeConfigured(
        node=NODE,
        policy="share-pool",
        qos=QosConfig(
            preempt_enabled=True, pod_max_duration_minutes=120, reserved_ephemeral_storage="1.5Ti"
        ),
        gpu_count=16,
    ),
    "NodeDisabled": NodeDisabled(node=NODE),
    "NodeRejected": NodeRejected(
        node=NODE,
        reason="InvalidPolicy",
        message="label alibabacloud.com/gpu-share-policy is 'exclusive'; "
        "it must be one of share-pool, static, none",
    ),
    "GpuInventoryReported": GpuInventoryReported(
        node=NODE,
        gpus=(
            GpuInfo(index=0, uuid=UUID, memory_mib=97871, name="NVIDIA H20"),
            GpuInfo(
                index=1,
                uuid="GPU-7d2e9a10-3c4b-4f5e-8a6b-1c2d3e4f5a6b",
                memory_mib=97871,
                name="NVIDIA H20",
            ),
        ),
        source="nvml",
    ),
    "PodRegistered": PodRegistered(
        pod=DEMO,
        node=NODE,
        policy="share-pool",
        requests=Share(core=10, memory=10),
        limits=Share(core=100, memory=100),
        priority=0,
        uid="8c5e7f0a-1b2c-4d3e-9f4a-5b6c7d8e9f01",
    ),
    "PodRejected": PodRejected(
        pod=DEMO,
        node=NODE,
        reason="LimitBelowRequest",
        message="container 'main' alibabacloud.com/gpu-core.percentage: limit 40 is below request 50",
    ),
    "PodReady": PodReady(pod=DEMO, node=NODE),
    "Assigned": Assigned(pod=DEMO, node=NODE, gpu_index=0, gpu_uuid=UUID),
    "Preempted": Preempted(
        victim=OLD, preemptor=DEMO, node=NODE, gpu_index=0, gpu_uuid=UUID, reason="max-duration"
    ),
    "Released": Released(
        pod=OLD, node=NODE, reason="preempted", gpu_index=0, gpu_uuid=UUID, exit_code=-9
    ),
    "PodRemoved": PodRemoved(pod=DEMO, node=NODE),
    "MessageRejected": MessageRejected(
        subject="gpupool.log.cn-wulanchabu-c_cr-xxx.PodReady",
        reason="not a gpupool envelope: JSON is malformed: invalid character (byte 4)",
        payload="not json",
        node=NODELESS,
        seq=7,
    ),
}


def envelope(tag: str) -> Envelope:
    index = list(EXPECTED).index(tag) + 1
    return Envelope(
        id=f"0196-5c1e-golden-{index:04d}",
        time=TIME,
        event=EXPECTED[tag],
        correlation_id="0196-5c1e-golden-corr",
        causation_id="" if index == 1 else f"0196-5c1e-golden-{index - 1:04d}",
        schema=SCHEMA_VERSION,
    )


def test_every_event_type_has_a_golden_sample() -> None:
    tags = {cls.__struct_config__.tag for cls in ALL_EVENT_TYPES}
    assert tags == set(EXPECTED)
    assert {path.stem for path in GOLDEN.glob("*.json")} == tags
    assert {event_tag(event) for event in EXPECTED.values()} == tags


@pytest.mark.parametrize("tag", list(EXPECTED))
def test_golden_sample_decodes_to_the_expected_event(tag: str) -> None:
    data = (GOLDEN / f"{tag}.json").read_bytes()
    decoded = decode_envelope(data)
    assert decoded == envelope(tag)
    assert json.loads(data)["schema"] == SCHEMA_VERSION
    assert json.loads(data)["event"]["type"] == tag
    # What the code writes today reads back the same, and has the same JSON content.
    assert decode_envelope(encode_envelope(decoded)) == decoded
    assert json.loads(encode_envelope(decoded)) == json.loads(data)


V1_EXPECTED = {
    "PodRegistered": PodRegistered(
        pod=DEMO,
        node=NODE,
        policy="share-pool",
        requests=Share(core=10, memory=50),
        limits=Share(core=100, memory=75),
        priority=3,
        uid="8c5e7f0a-1b2c-4d3e-9f4a-5b6c7d8e9f01",
    ),
    "Assigned": Assigned(pod=DEMO, node=NODE, gpu_index=1, gpu_uuid=""),
    "PodReady": PodReady(pod=DEMO, node=NODE),
}


@pytest.mark.parametrize("tag", list(V1_EXPECTED))
def test_v1_samples_are_upcast(tag: str) -> None:
    data = (GOLDEN / "v1" / f"{tag}.json").read_bytes()
    assert json.loads(data)["schema"] == 1
    decoded = decode_envelope(data)
    assert decoded.event == V1_EXPECTED[tag]
    assert decoded.schema == SCHEMA_VERSION
    assert decoded.time == TIME


def test_every_v1_sample_is_checked() -> None:
    assert {path.stem for path in (GOLDEN / "v1").glob("*.json")} == set(V1_EXPECTED)


def test_v1_fractions_become_percentages() -> None:
    raw = json.loads((GOLDEN / "v1" / "PodRegistered.json").read_bytes())
    assert raw["event"]["requests"] == {"core": 0.1, "memory": 0.5}
    assert raw["event"]["limits"] == {"core": 1.0, "memory": 0.75}


@pytest.mark.parametrize("version", [99, 4, 0, -1])
def test_an_unknown_schema_version_fails_loudly(version: int) -> None:
    raw = json.loads((GOLDEN / "PodReady.json").read_bytes())
    raw["schema"] = version
    with pytest.raises(UnknownSchemaVersion, match=f"schema version {version} is unknown"):
        decode_envelope(json.dumps(raw).encode())


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"not json", id="not-json"),
        pytest.param(b"\xff\xfe", id="binary"),
        pytest.param(b"[1, 2]", id="an-array"),
        pytest.param(b'{"schema": "2"}', id="schema-as-string"),
        pytest.param(b'{"schema": 2}', id="no-event"),
        pytest.param(
            b'{"id": "x", "time": "2025-04-22T08:12:09Z", "event": {"type": "PodExploded"}}',
            id="unknown-event-type",
        ),
        pytest.param(
            b'{"id": "x", "time": "2025-04-22T08:12:09Z", "event": {"type": "PodReady", '
            b'"pod": {"namespace": "default", "name": "p"}}}',
            id="missing-field",
        ),
        pytest.param(
            b'{"id": "x", "time": "yesterday", "event": {"type": "PodRemoved", '
            b'"pod": {"namespace": "default", "name": "p"}, "node": "n"}}',
            id="bad-time",
        ),
        pytest.param(
            b'{"id": "x", "time": "2025-04-22T08:12:09Z", "event": {"type": "Assigned", '
            b'"pod": {"namespace": "default", "name": "p"}, "node": "n", "gpu_index": "0", '
            b'"gpu_uuid": ""}}',
            id="wrong-type",
        ),
        pytest.param(b'{"schema": 1, "id": "x"}', id="v1-without-event"),
        pytest.param(
            b'{"schema": 1, "id": "x", "time": "2025-04-22T08:12:09Z", "event": {"type": '
            b'"PodRegistered", "pod": {"namespace": "d", "name": "p"}, "node": "n", "policy": '
            b'"share-pool", "requests": {"core": "half", "memory": 0.5}, "limits": {}}}',
            id="v1-fraction-not-a-number",
        ),
        pytest.param(b'{"schema": 1, "event": "PodReady"}', id="v1-event-not-an-object"),
    ],
)
def test_garbage_fails_with_event_decode_error(data: bytes) -> None:
    with pytest.raises(EventDecodeError):
        decode_envelope(data)


def test_a_rejection_written_before_it_named_its_sequence_reads_with_sequence_zero() -> None:
    data = (GOLDEN / "v2" / "MessageRejected-before-seq.json").read_bytes()
    assert "seq" not in json.loads(data)["event"]
    decoded = decode_envelope(data)
    assert decoded.event == msgspec.structs.replace(EXPECTED["MessageRejected"], seq=0)


def test_a_decision_entry_is_not_read_as_one_envelope() -> None:
    raw = json.loads((GOLDEN / "PodReady.json").read_bytes())
    entry = json.dumps({"schema": 3, "envelopes": [raw, raw]}).encode()
    with pytest.raises(EventDecodeError, match="decode_entry"):
        decode_envelope(entry)


def test_unknown_fields_are_ignored_and_missing_defaults_filled() -> None:
    """Forward compatibility by msgspec's rules: a newer writer's extra fields do not break us."""
    raw = json.loads((GOLDEN / "Released.json").read_bytes())
    raw["added_later"] = {"anything": [1, 2]}
    raw["event"]["added_later"] = "x"
    del raw["event"]["exit_code"]
    del raw["schema"]  # absent: the current version
    decoded = decode_envelope(json.dumps(raw).encode())
    expected = envelope("Released")
    assert decoded == msgspec.structs.replace(
        expected, event=msgspec.structs.replace(EXPECTED["Released"], exit_code=None)
    )


# --------------------------------------------------------------------------- JSON Schema


def _generator() -> ModuleType:
    path = ROOT / "scripts" / "generate_event_schema.py"
    spec = importlib.util.spec_from_file_location("generate_event_schema", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_checked_in_json_schema_is_what_the_code_generates() -> None:
    checked_in = (ROOT / "docs" / "events.schema.json").read_text()
    assert checked_in == _generator().render(), (
        "docs/events.schema.json is stale: run `python scripts/generate_event_schema.py`"
    )


def test_the_json_schema_names_every_event_and_the_envelope() -> None:
    schema = event_json_schema()
    defs = schema["$defs"]
    assert "Envelope" in defs
    for cls in ALL_EVENT_TYPES:
        tag = cls.__struct_config__.tag
        assert defs[cls.__name__]["properties"]["type"]["enum"] == [tag]


@pytest.mark.parametrize("tag", list(EXPECTED))
def test_golden_samples_validate_against_the_checked_in_json_schema(tag: str) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((ROOT / "docs" / "events.schema.json").read_text())
    jsonschema.validate(json.loads((GOLDEN / f"{tag}.json").read_bytes()), schema)
    broken = json.loads((GOLDEN / f"{tag}.json").read_bytes())
    del broken["event"]["type"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)
