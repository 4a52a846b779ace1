"""Fuzzers (hypothesis, derandomized, bounded) against what the services decode from
outside: the log codec, the cluster file loader and the QoS annotation parser.

The property: any input gives a value or the decoder's specific rejection
(EventDecodeError, ConfigError, a Rejection) — never another exception. The poison
entries of issue 12 are explicit seeds (``@example``), so they run on every run
whatever the generator draws.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from core_gwt import T0
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_log_poison import NESTED_1000, SHARE_INF_V1, assigned_json

from gpupool.core import decide, fold
from gpupool.core.validation import Rejection, parse_qos_annotation
from gpupool.eventlog.port import StoredEvent, Undecodable, read_entries
from gpupool.eventlog.subjects import subject_for
from gpupool.events import (
    Envelope,
    EventDecodeError,
    QosConfig,
    decode_entry,
    encode_entry,
    encode_envelope,
)
from gpupool.policy.local_config import (
    ConfigError,
    LocalCluster,
    load_local_cluster,
    node_commands,
    pod_commands,
)

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)

json_values: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(["inf", "-inf", "nan", "1e10", "", "gpu node", "*", ">", "n1"])
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)

EVENT_KEYS = (
    "type",
    "pod",
    "node",
    "policy",
    "requests",
    "limits",
    "gpu_index",
    "gpu_uuid",
    "priority",
    "reason",
    "gpus",
    "qos",
    "victim",
    "preemptor",
)
TAGS = ["PodRegistered", "Assigned", "Released", "Preempted", "NodeConfigured", "PodReady"]


@st.composite
def envelope_like(draw: st.DrawFn) -> bytes:
    """JSON shaped like an envelope (so the fuzzer reaches the typed decode and the upcaster)."""
    event: dict[str, Any] = {"type": draw(st.sampled_from(TAGS))}
    for key in draw(st.lists(st.sampled_from(EVENT_KEYS[1:]), max_size=6, unique=True)):
        event[key] = draw(json_values)
    raw: dict[str, Any] = {
        "schema": draw(st.sampled_from([1, 2, 3, 0, -1, 2**70])),
        "id": draw(st.text(max_size=8)),
        "time": draw(st.sampled_from(["2025-04-22T08:00:00Z", "9999-12-31T23:59:59Z", "x", 5])),
        "event": event,
    }
    if raw["schema"] == 3:
        raw = {"schema": 3, "envelopes": [{**raw, "schema": 2}]}
    return json.dumps(raw).encode()


def decodes_or_refuses(data: bytes) -> None:
    try:
        envelopes = decode_entry(data)
    except EventDecodeError:
        return
    assert envelopes
    assert decode_entry(encode_entry(list(envelopes))) == envelopes


@FUZZ
@given(st.binary(max_size=300) | envelope_like())
@example(NESTED_1000)
@example(NESTED_1000.replace(b'"schema":2', b'"schema":1'))
@example(SHARE_INF_V1)
@example(SHARE_INF_V1.replace(b'"inf"', b'"nan"'))
@example(assigned_json(2**70))
@example(b'{"schema":3,"envelopes":' + b"[" * 5000 + b"]" * 5000 + b"}")
def test_the_log_codec_returns_envelopes_or_a_decode_error(data: bytes) -> None:
    decodes_or_refuses(data)


@FUZZ
@given(
    envelope_like(), st.sampled_from(["gpupool.log.n1.X", "gpupool.log.n2.X", "gpupool.log._.X"])
)
@example(assigned_json(0, node="n1"), "gpupool.log.n2.Assigned")
def test_reading_an_entry_gives_events_of_its_subjects_node_or_one_undecodable(
    data: bytes, subject: str
) -> None:
    entries = read_entries(1, subject, data)
    if any(isinstance(entry, Undecodable) for entry in entries):
        assert len(entries) == 1
        return
    node = subject.split(".")[-2]
    for entry in entries:
        assert isinstance(entry, StoredEvent)
        assert (entry.envelope.event.node or "_") == node


QOS_KEYS = [
    "preemptEnabled",
    "podMaxDurationMinutes",
    "reservedEphemeralStorage",
    "backfill",
    "preemptGracePeriodSeconds",
    "waitingMessagePeriodSeconds",
    "unknown",
]


@st.composite
def qos_like(draw: st.DrawFn) -> str:
    keys = draw(st.lists(st.sampled_from(QOS_KEYS), max_size=4, unique=True))
    return json.dumps({key: draw(json_values) for key in keys})


@FUZZ
@given(qos_like() | st.text(max_size=60) | json_values.map(json.dumps))
@example('{"preemptEnabled": true, "podMaxDurationMinutes": 1e10}')
@example('{"preemptEnabled": true, "podMaxDurationMinutes": 10000000000}')
@example("[" * 5000 + "]" * 5000)
@example('{"backfill":' + "[" * 900 + "]" * 900 + "}")
@example('{"reservedEphemeralStorage": "1e400Ei"}')
def test_the_qos_parser_returns_a_config_or_a_rejection(text: str) -> None:
    parsed = parse_qos_annotation(text)
    if isinstance(parsed, Rejection):
        assert parsed.reason == "InvalidQosConfig"
        return
    assert isinstance(parsed, QosConfig)
    minutes = parsed.pod_max_duration_minutes
    assert minutes is None or 1 <= minutes <= 10 * 366 * 24 * 60


@pytest.fixture(scope="module")
def cluster_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One file the cluster fuzzer rewrites for each example (a directory each is slow)."""
    return tmp_path_factory.mktemp("cluster") / "cluster.yaml"


@st.composite
def cluster_like(draw: st.DrawFn) -> str:
    name = draw(st.sampled_from(["n1", "gpu node", "*", "n" * 300]) | st.text(max_size=8))
    node: dict[str, Any] = {"name": name, "gpus": draw(json_values | st.integers(0, 4))}
    if draw(st.booleans()):
        node["qos"] = draw(qos_like())
    pod = {
        "name": draw(st.text(max_size=8)),
        "node": draw(st.sampled_from([name, "n1"])),
        "priority": draw(json_values | st.integers(-(2**40), 2**40)),
        "requests": {"core": draw(json_values | st.integers(0, 200)), "memory": 50},
    }
    document = {"nodes": [node], "pods": draw(st.sampled_from([[pod], [], pod, None]))}
    return json.dumps(document)  # JSON is YAML


@settings(FUZZ, max_examples=60)
@given(cluster_like() | st.text(max_size=80))
@example("nodes: " + "[" * 5000 + "]" * 5000)
@example("nodes:\n- {name: n1, gpus: 100000000000000000000000}\n")
@example("nodes:\n- {name: 'gpu node', gpus: 1}\npods:\n- {name: p, node: 'gpu node'}\n")
@example("a: &a [*a, *a]\n")
@example('{"nodes": [{"name": "n1", "gpus": 1}], "pods": [{"name": "\\ud800", "node": "n1"}]}')
@example("nodes: !!python/object/apply:os.system ['true']\n")
def test_the_cluster_file_loader_returns_a_cluster_or_a_config_error(
    cluster_file: Path, text: str
) -> None:
    path = cluster_file
    path.write_text(text, errors="surrogatepass")
    try:
        cluster = load_local_cluster(path)
    except ConfigError as error:
        refusal = str(error)
    else:
        refusal = ""
    if refusal:
        assert str(path) in refusal
        return
    assert isinstance(cluster, LocalCluster)
    # what the policy service then decides from it is recorded, and the log can read it back
    state = fold([])
    for command in [*node_commands(cluster), *pod_commands(cluster)]:
        for event in decide(state, command, T0):
            envelope = Envelope(id="e", time=T0, event=event)
            (entry,) = read_entries(1, subject_for(event), encode_envelope(envelope))
            assert isinstance(entry, StoredEvent), entry
