"""Hostile inputs the policy and preemption services decode: each is a specific rejection
recorded in the log, and the service goes on (issue 12's findings, one test each).

* a QoS annotation with ``podMaxDurationMinutes: 1e10`` (the preemption service died on
  "date value out of range", stopping preemption on every node);
* a QoS annotation nested 5,000 deep (RecursionError in the policy service);
* a node name with a space, ``*``, ``>`` or 100,000 characters (the policy service died
  building the log subject, with no event).
"""

from __future__ import annotations

import pytest
from core_gwt import T0, ref

from gpupool.core import ConfigureNode, RegisterPod, decide, fold
from gpupool.core.validation import (
    COMPUTE_CLASS_LABEL,
    CORE_RESOURCE,
    MEMORY_RESOURCE,
    POLICY_LABEL,
    ContainerResources,
    PodManifest,
    Rejection,
    parse_qos_annotation,
)
from gpupool.eventlog import InMemoryEventLog
from gpupool.eventlog.port import StoredEvent
from gpupool.events import NODELESS, NodeConfigured, NodeRejected, PodRejected
from gpupool.policy.service import command_node
from gpupool.runtime.decider import DeciderLoop

BAD_NODE_NAMES = ["gpu node", "gpu-*", "gpu->", "n" * 100_000, "gpu_node", "", "-gpu"]


@pytest.mark.parametrize(
    "annotation",
    [
        '{"preemptEnabled": true, "podMaxDurationMinutes": 10000000000}',
        '{"preemptEnabled": true, "podMaxDurationMinutes": 1e10}',
        '{"preemptGracePeriodSeconds": 10000000000}',
        '{"waitingMessagePeriodSeconds": 100000000000000000000000}',
    ],
)
def test_a_qos_number_past_its_range_is_an_invalid_qos_config(annotation: str) -> None:
    parsed = parse_qos_annotation(annotation)
    assert isinstance(parsed, Rejection)
    assert parsed.reason == "InvalidQosConfig"
    assert "must be" in parsed.message


def test_the_longest_allowed_qos_duration_is_accepted() -> None:
    parsed = parse_qos_annotation('{"preemptEnabled": true, "podMaxDurationMinutes": 5270400}')
    assert not isinstance(parsed, Rejection)
    assert parsed.pod_max_duration_minutes == 5270400


def test_a_qos_annotation_nested_5000_deep_is_an_invalid_qos_config() -> None:
    for annotation in ("[" * 5000 + "]" * 5000, '{"backfill":' + "[" * 5000 + "]" * 5000 + "}"):
        parsed = parse_qos_annotation(annotation)
        assert isinstance(parsed, Rejection)
        assert parsed.reason == "InvalidQosConfig"
        assert "characters long" in parsed.message
    deep_but_short = "[" * 1500 + "]" * 1500
    parsed = parse_qos_annotation(deep_but_short)
    assert isinstance(parsed, Rejection)


@pytest.mark.parametrize("name", BAD_NODE_NAMES, ids=lambda n: repr(n[:12]))
def test_a_node_name_no_node_can_have_is_rejected_on_no_node(name: str) -> None:
    events = decide(fold([]), ConfigureNode(node=name, policy_label="share-pool"), T0)
    assert len(events) == 1
    rejected = events[0]
    assert isinstance(rejected, NodeRejected)
    assert (rejected.node, rejected.reason) == (NODELESS, "InvalidNodeName")
    assert len(rejected.message) < 400
    assert command_node(ConfigureNode(node=name, policy_label="share-pool")) == NODELESS


def manifest(node: str, **changes: object) -> PodManifest:
    fields: dict[str, object] = {
        "namespace": "default",
        "name": "p",
        "node": node,
        "labels": {COMPUTE_CLASS_LABEL: "gpu-hpn", POLICY_LABEL: "share-pool"},
        "containers": (
            ContainerResources(name="c", requests={CORE_RESOURCE: 50, MEMORY_RESOURCE: 50}),
        ),
    }
    fields.update(changes)
    return PodManifest(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("pod", "reason"),
    [
        (manifest("gpu node"), "InvalidNodeName"),
        (manifest("n1", name="p" * 300), "InvalidPodName"),
        (manifest("n1", namespace="n" * 64), "InvalidPodName"),
        (manifest("n1", priority=2**40), "InvalidPriority"),
        (manifest("n1", uid="u" * 1000), "InvalidPodUid"),
    ],
)
def test_a_pod_the_log_cannot_hold_is_rejected(pod: PodManifest, reason: str) -> None:
    events = decide(fold([]), RegisterPod(manifest=pod), T0)
    assert [type(e) for e in events] == [PodRejected]
    assert events[0].reason == reason  # type: ignore[union-attr]


async def test_the_policy_loop_records_a_bad_node_name_and_configures_the_next_node(
    memory_log: InMemoryEventLog,
) -> None:
    loop = DeciderLoop(memory_log, service="policy")
    await loop.rebuild()
    for name in [*BAD_NODE_NAMES, "gpu-node-1"]:
        command = ConfigureNode(node=name, policy_label="share-pool", gpu_count=1)
        await loop.execute(command, node=command_node(command))
    pod = manifest("gpu node", name="q")
    await loop.execute(RegisterPod(manifest=pod), node=command_node(RegisterPod(manifest=pod)))
    recorded = [
        entry.envelope.event
        async for entry in memory_log.replay()
        if isinstance(entry, StoredEvent)
    ]
    assert [type(e) for e in recorded] == [NodeRejected] * len(BAD_NODE_NAMES) + [
        NodeConfigured,
        PodRejected,
    ]
    assert "gpu-node-1" in loop.projection.state.nodes
    assert NODELESS not in loop.projection.state.nodes
    assert ref("q") not in loop.projection.state.pods


def test_a_node_advertising_more_gpus_than_the_log_holds_is_rejected() -> None:
    events = decide(
        fold([]), ConfigureNode(node="n1", policy_label="share-pool", gpu_count=2**70), T0
    )
    assert [(type(e), getattr(e, "reason", "")) for e in events] == [
        (NodeRejected, "InvalidGpuCount")
    ]
