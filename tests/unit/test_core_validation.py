"""Every rejection the core can make (validation.py and decide.py), QoS parsing and quantities."""

from __future__ import annotations

import copy
import re
from decimal import Decimal
from pathlib import Path

import pytest
from core_gwt import (
    NODE,
    T0,
    Given,
    Run,
    Wait,
    given_state,
    gpu_uuid,
    gpus,
    gwt,
    manifest,
    node_events,
    ref,
    registered,
    topology,
)

import gpupool.core
from gpupool.core import (
    Command,
    ConfigureNode,
    ContainerResources,
    PodManifest,
    PodSpec,
    RegisterPod,
    Rejection,
    RemovePod,
    ReportInventory,
    ReportRelease,
    RequestGpu,
    decide,
    parse_qos_annotation,
    parse_quantity,
    validate_node_policy,
    validate_pod,
)
from gpupool.core.validation import (
    COMPUTE_CLASS_LABEL,
    CORE_RESOURCE,
    MEMORY_RESOURCE,
    POLICY_LABEL,
    format_quantity,
)
from gpupool.events import (
    Assigned,
    Event,
    GpuInventoryReported,
    NodeConfigured,
    NodeDisabled,
    NodeRejected,
    PodReady,
    PodRegistered,
    PodRejected,
    PodRemoved,
    QosConfig,
    Released,
    Share,
)

CORE, MEM = CORE_RESOURCE, MEMORY_RESOURCE
SOURCE_QOS = (
    '{"preemptEnabled": true, "podMaxDurationMinutes": 120, "reservedEphemeralStorage": "1.5Ti"}'
)
SHARE_LABELS = {COMPUTE_CLASS_LABEL: "gpu-hpn", POLICY_LABEL: "share-pool"}


def box(
    name: str, requests: dict[str, str | int], limits: dict[str, str | int] | None = None
) -> ContainerResources:
    return ContainerResources(name=name, requests=requests, limits=limits or {})


# --------------------------------------------------------------------------- pod specs

POD_REJECTIONS = [
    pytest.param(
        manifest(labels={POLICY_LABEL: "share-pool"}),
        "UnsupportedComputeClass",
        id="no-compute-class",
    ),
    pytest.param(
        manifest(labels={COMPUTE_CLASS_LABEL: "gpu-lite", POLICY_LABEL: "share-pool"}),
        "UnsupportedComputeClass",
        id="other-compute-class",
    ),
    pytest.param(
        manifest(labels={COMPUTE_CLASS_LABEL: "gpu-hpn"}), "InvalidSharePolicy", id="no-policy"
    ),
    pytest.param(manifest(policy="none"), "InvalidSharePolicy", id="policy-none"),
    pytest.param(manifest(policy="exclusive"), "InvalidSharePolicy", id="policy-unknown"),
    pytest.param(
        manifest(containers=(box("main", {CORE: 10, MEM: 10, "nvidia.com/gpu": 1}),)),
        "MixedExclusiveAndShare",
        id="share-and-nvidia-gpu-in-one-container",
    ),
    pytest.param(
        manifest(containers=(box("main", {CORE: 10, MEM: 10}, {"nvidia.com/gpu": 1}),)),
        "MixedExclusiveAndShare",
        id="nvidia-gpu-limit-beside-share-request",
    ),
    pytest.param(manifest(containers=()), "NoGpuShareContainer", id="no-containers"),
    pytest.param(
        manifest(containers=(box("main", {"cpu": "1"}), box("gpu", {"nvidia.com/gpu": 1}))),
        "NoGpuShareContainer",
        id="no-container-asks-for-shares",
    ),
    pytest.param(
        manifest(containers=(box("a", {CORE: 10, MEM: 10}), box("b", {CORE: 10, MEM: 10}))),
        "MultipleGpuShareContainers",
        id="two-sharing-containers",
    ),
    pytest.param(manifest(requests={CORE: 0, MEM: 10}), "InvalidPercentage", id="zero"),
    pytest.param(
        manifest(requests={CORE: 10, MEM: 101}), "InvalidPercentage", id="101-more-than-one-gpu"
    ),
    pytest.param(manifest(limits={CORE: 101, MEM: 100}), "InvalidPercentage", id="limit-101"),
    pytest.param(manifest(requests={CORE: "abc", MEM: 10}), "InvalidPercentage", id="abc"),
    pytest.param(
        manifest(requests={CORE: "1.5", MEM: 10}), "InvalidPercentage", id="1.5-as-string"
    ),
    pytest.param(
        manifest(requests={CORE: "-5", MEM: 10}), "InvalidPercentage", id="negative-string"
    ),
    pytest.param(manifest(requests={CORE: -5, MEM: 10}), "InvalidPercentage", id="negative"),
    pytest.param(manifest(requests={CORE: "", MEM: 10}), "InvalidPercentage", id="empty-string"),
    pytest.param(manifest(requests={CORE: True, MEM: 10}), "InvalidPercentage", id="boolean"),
    pytest.param(
        manifest(requests={CORE: 10}, limits={CORE: 100}), "MissingShareResource", id="no-memory"
    ),
    pytest.param(
        manifest(requests={MEM: 10}, limits={MEM: 100}), "MissingShareResource", id="no-core"
    ),
    pytest.param(
        manifest(requests={CORE: 10}, limits={CORE: 100, MEM: 100}),
        "MissingRequest",
        id="memory-limit-without-request",
    ),
    pytest.param(
        manifest(requests={MEM: 10}, limits={CORE: 100, MEM: 100}),
        "MissingRequest",
        id="core-limit-without-request",
    ),
    pytest.param(
        manifest(requests={CORE: 50, MEM: 50}, limits={CORE: 40, MEM: 50}),
        "LimitBelowRequest",
        id="core-limit-below-request",
    ),
    pytest.param(
        manifest(requests={CORE: 50, MEM: 50}, limits={CORE: 50, MEM: 49}),
        "LimitBelowRequest",
        id="memory-limit-below-request",
    ),
]


@pytest.mark.parametrize(("pod", "reason"), POD_REJECTIONS)
def test_validate_pod_rejects(pod: PodManifest, reason: str) -> None:
    rejection = validate_pod(pod)
    assert isinstance(rejection, Rejection)
    assert rejection.reason == reason
    assert rejection.message


@pytest.mark.parametrize(
    ("pod", "expected"),
    [
        pytest.param(
            manifest(),
            PodSpec(
                policy="share-pool",
                requests=Share(core=10, memory=10),
                limits=Share(core=100, memory=100),
            ),
            id="source-sample",
        ),
        pytest.param(
            manifest(requests={CORE: 50, MEM: 30}, limits={}),
            PodSpec(
                policy="share-pool",
                requests=Share(core=50, memory=30),
                limits=Share(core=50, memory=30),
            ),
            id="missing-limit-equals-request",
        ),
        pytest.param(
            manifest(requests={CORE: "1", MEM: " 100 "}, limits={CORE: "100"}, policy="static"),
            PodSpec(
                policy="static",
                requests=Share(core=1, memory=100),
                limits=Share(core=100, memory=100),
            ),
            id="strings-and-bounds",
        ),
        pytest.param(
            manifest(
                containers=(
                    box("sidecar", {"cpu": "1"}),
                    box("main", {CORE: 20, MEM: 20}, {CORE: 40, MEM: 40}),
                )
            ),
            PodSpec(
                policy="share-pool",
                requests=Share(core=20, memory=20),
                limits=Share(core=40, memory=40),
            ),
            id="other-containers-may-stay",
        ),
    ],
)
def test_validate_pod_accepts(pod: PodManifest, expected: PodSpec) -> None:
    assert validate_pod(pod) == expected


def test_rejection_messages_say_what_is_wrong() -> None:
    bad = validate_pod(manifest(requests={CORE: "abc", MEM: 10}))
    assert isinstance(bad, Rejection)
    assert "'abc'" in bad.message and CORE in bad.message and "'main'" in bad.message
    over = validate_pod(manifest(requests={CORE: 10, MEM: 101}))
    assert isinstance(over, Rejection)
    assert "one GPU" in over.message


# --------------------------------------------------------------------------- decide: pods

SHARE_NODE: list[Given] = list(node_events(2))
STATIC_NODE: list[Given] = list(node_events(2, policy="static"))


DECIDE_REJECTIONS = [
    pytest.param(
        [], RegisterPod(manifest=manifest()), "NodeNotEnabled", id="register-unknown-node"
    ),
    pytest.param(
        [
            *STATIC_NODE,
            registered("a", 60, policy="static"),
            Assigned(pod=ref("a"), node=NODE, gpu_index=0, gpu_uuid=gpu_uuid(0)),
            PodRemoved(pod=ref("a"), node=NODE),
        ],
        RegisterPod(manifest=manifest("a", policy="static", uid="uid-recreated")),
        "PreviousPodReleasing",
        id="recreated-while-the-deleted-one-releases",
    ),
    pytest.param(
        [
            *SHARE_NODE,
            registered("a", 60),
            PodReady(pod=ref("a"), node=NODE),
            Assigned(pod=ref("a"), node=NODE, gpu_index=0, gpu_uuid=gpu_uuid(0)),
            PodRemoved(pod=ref("a"), node=NODE),
        ],
        RequestGpu(pod=ref("a"), node=NODE),
        "PodDeleted",
        id="request-for-a-deleted-releasing-pod",
    ),
    pytest.param(
        [
            GpuInventoryReported(node=NODE, gpus=(), source="simulated"),
            NodeConfigured(node=NODE, policy="static", gpu_count=2),
            registered("a", 60, policy="static"),
        ],
        RequestGpu(pod=ref("a"), node=NODE),
        "NoStaticGpu",
        id="static-pod-waiting-for-its-gpu",
    ),
    pytest.param(
        [*SHARE_NODE, NodeDisabled(node=NODE)],
        RegisterPod(manifest=manifest()),
        "NodeNotEnabled",
        id="register-disabled-node",
    ),
    pytest.param(
        SHARE_NODE,
        RegisterPod(manifest=manifest(policy="static")),
        "PolicyMismatch",
        id="static-pod-share-node",
    ),
    pytest.param(
        STATIC_NODE, RegisterPod(manifest=manifest()), "PolicyMismatch", id="share-pod-static-node"
    ),
    pytest.param(
        [*SHARE_NODE, registered("a", 70), registered("b", 70)],
        RegisterPod(manifest=manifest(requests={CORE: 61, MEM: 10})),
        "InsufficientAllocatable",
        id="core-requests-over-allocatable",
    ),
    pytest.param(
        [
            *SHARE_NODE,
            registered("a", Share(core=10, memory=100)),
            registered("b", Share(core=10, memory=100)),
        ],
        RegisterPod(manifest=manifest(requests={CORE: 10, MEM: 1})),
        "InsufficientAllocatable",
        id="memory-requests-over-allocatable",
    ),
    pytest.param(
        [
            *STATIC_NODE,
            registered("a", 60, policy="static"),
            Assigned(pod=ref("a"), node=NODE, gpu_index=0, gpu_uuid=gpu_uuid(0)),
            registered("b", 60, policy="static"),
            Assigned(pod=ref("b"), node=NODE, gpu_index=1, gpu_uuid=gpu_uuid(1)),
        ],
        RegisterPod(manifest=manifest(requests={CORE: 50, MEM: 50}, policy="static")),
        "NoStaticGpuFits",
        id="static-fits-allocatable-but-no-gpu",
    ),
    pytest.param(
        [*SHARE_NODE, registered("gpu-share-demo", 10)],
        RegisterPod(manifest=manifest(uid="another-uid")),
        "AlreadyRegistered",
        id="same-name-other-uid",
    ),
    pytest.param(
        [*SHARE_NODE, *node_events(1, node="other"), registered("gpu-share-demo", 10)],
        RegisterPod(manifest=manifest(node="other")),
        "AlreadyRegistered",
        id="same-name-other-node",
    ),
    pytest.param(
        SHARE_NODE, RequestGpu(pod=ref("nobody"), node=NODE), "UnknownPod", id="request-unknown-pod"
    ),
    pytest.param(
        [*SHARE_NODE, registered("p", 10)],
        RequestGpu(pod=ref("p"), node="elsewhere"),
        "WrongNode",
        id="request-wrong-node",
    ),
    pytest.param(
        [*SHARE_NODE, registered("p", 10), NodeDisabled(node=NODE)],
        RequestGpu(pod=ref("p"), node=NODE),
        "NodeNotEnabled",
        id="request-on-disabled-node",
    ),
    pytest.param(
        topology(1, [], [Wait("p", 10)]),
        RequestGpu(pod=ref("p"), node=NODE),
        "NotDormant",
        id="request-while-ready",
    ),
    pytest.param(
        topology(1, [Run("p", 0, 10)]),
        RequestGpu(pod=ref("p"), node=NODE),
        "NotDormant",
        id="request-while-running",
    ),
    pytest.param(
        [NodeConfigured(node=NODE, policy="share-pool", gpu_count=2), registered("p", 10)],
        RequestGpu(pod=ref("p"), node=NODE),
        "NoGpus",
        id="request-before-inventory",
    ),
    pytest.param(
        SHARE_NODE,
        ReportRelease(pod=ref("nobody"), node=NODE, reason="completed"),
        "UnknownPod",
        id="release-unknown-pod",
    ),
    pytest.param(
        [*SHARE_NODE, registered("p", 10)],
        ReportRelease(pod=ref("p"), node=NODE, reason="completed"),
        "NotRunning",
        id="release-dormant",
    ),
    pytest.param(
        topology(1, [], [Wait("p", 10)]),
        ReportRelease(pod=ref("p"), node=NODE, reason="completed"),
        "NotRunning",
        id="complete-while-waiting",
    ),
]


def only_event(given: list[Given], when: Command) -> Event:
    state = given_state(given)
    before = copy.deepcopy(state)
    events = decide(state, when, T0)
    assert state == before
    assert len(events) == 1, events
    return events[0]


@pytest.mark.parametrize(("given", "when", "reason"), DECIDE_REJECTIONS)
def test_decide_rejects_pod_commands(given: list[Given], when: Command, reason: str) -> None:
    event = only_event(given, when)
    assert isinstance(event, PodRejected)
    if isinstance(when, RegisterPod):
        target = (ref(when.manifest.name), when.manifest.node)
    else:
        assert isinstance(when, RequestGpu | ReportRelease)
        target = (when.pod, when.node)
    assert (event.reason, event.pod, event.node) == (reason, *target)
    assert event.message


def test_registering_the_same_pod_again_is_a_no_op() -> None:
    gwt(
        given=[*SHARE_NODE, registered("gpu-share-demo", 10, 100)],
        when=RegisterPod(manifest=manifest()),
        then=[],
    )


def test_register_admits_by_requests_up_to_exactly_allocatable() -> None:
    gwt(
        given=[*SHARE_NODE, registered("a", 70), registered("b", 70)],
        when=RegisterPod(
            manifest=manifest(requests={CORE: 60, MEM: 60}, limits={CORE: 100, MEM: 100})
        ),
        then=[
            PodRegistered(
                pod=ref("gpu-share-demo"),
                node=NODE,
                policy="share-pool",
                requests=Share(core=60, memory=60),
                limits=Share(core=100, memory=100),
                uid="uid-gpu-share-demo",
            )
        ],
    )


def test_removing_a_pod_frees_its_requests_and_unknown_removal_is_a_no_op() -> None:
    given = [*SHARE_NODE, registered("a", 100), registered("b", 100)]
    gwt(given=given, when=RemovePod(pod=ref("nobody"), node=NODE), then=[])
    state = gwt(
        given=given,
        when=RemovePod(pod=ref("a"), node=NODE),
        then=[PodRemoved(pod=ref("a"), node=NODE)],
    )
    assert ref("a") not in state.pods and list(state.nodes[NODE].pods) == [ref("b")]
    gwt(
        given=[*given, PodRemoved(pod=ref("a"), node=NODE)],
        when=RegisterPod(manifest=manifest(requests={CORE: 100, MEM: 100})),
        then=[
            PodRegistered(
                pod=ref("gpu-share-demo"),
                node=NODE,
                policy="share-pool",
                requests=Share(core=100, memory=100),
                limits=Share(core=100, memory=100),
                uid="uid-gpu-share-demo",
            )
        ],
    )


def test_a_waiting_pod_may_cancel() -> None:
    gwt(
        given=topology(1, [], [Wait("p", 10)]),
        when=ReportRelease(pod=ref("p"), node=NODE, reason="cancelled"),
        then=[Released(pod=ref("p"), node=NODE, reason="cancelled")],
    )


# --------------------------------------------------------------------------- decide: nodes

NODE_REJECTIONS = [
    pytest.param(
        [], ConfigureNode(node=NODE, policy_label="exclusive"), "InvalidPolicy", id="unknown-policy"
    ),
    pytest.param(
        [],
        ConfigureNode(node=NODE, policy_label="Share-Pool"),
        "InvalidPolicy",
        id="policy-is-case-sensitive",
    ),
    pytest.param(
        [],
        ConfigureNode(
            node=NODE, policy_label="share-pool", qos_annotation="{preemptEnabled: true}"
        ),
        "InvalidQosConfig",
        id="qos-bad-json",
    ),
    pytest.param(
        [],
        ConfigureNode(
            node=NODE, policy_label="share-pool", exclusive_gpu_pods=("default/trainer",)
        ),
        "ExclusiveGpuPodsPresent",
        id="whole-gpu-pods-block-enabling",
    ),
    pytest.param(
        [*SHARE_NODE, registered("p", 10)],
        ConfigureNode(node=NODE, policy_label="none"),
        "SharePodsPresent",
        id="disable-with-share-pods",
    ),
    pytest.param(
        [*SHARE_NODE, registered("p", 10)],
        ConfigureNode(node=NODE, policy_label=None),
        "SharePodsPresent",
        id="label-removed-with-share-pods",
    ),
    pytest.param(
        [*SHARE_NODE, registered("p", 10)],
        ConfigureNode(node=NODE, policy_label="static", gpu_count=2),
        "SharePodsPresent",
        id="change-model-with-share-pods",
    ),
]


@pytest.mark.parametrize(("given", "when", "reason"), NODE_REJECTIONS)
def test_decide_rejects_node_configurations(
    given: list[Given], when: ConfigureNode, reason: str
) -> None:
    event = only_event(given, when)
    assert isinstance(event, NodeRejected)
    assert (event.reason, event.node) == (reason, NODE)
    assert event.message


def test_node_configuration_is_accepted_once_and_cleared_by_a_valid_one() -> None:
    configure = ConfigureNode(
        node=NODE, policy_label="share-pool", qos_annotation=SOURCE_QOS, gpu_count=16
    )
    qos = QosConfig(
        preempt_enabled=True, pod_max_duration_minutes=120, reserved_ephemeral_storage="1.5Ti"
    )
    enabled = NodeConfigured(node=NODE, policy="share-pool", qos=qos, gpu_count=16)
    state = gwt(given=[], when=configure, then=[enabled])
    assert state.nodes[NODE].enabled and state.nodes[NODE].allocatable_percent == 1600
    gwt(given=[enabled], when=configure, then=[])  # nothing changed: nothing to record
    bad = NodeRejected(node=NODE, reason="InvalidQosConfig", message="...")
    state = gwt(given=[enabled, bad], when=configure, then=[enabled])
    assert state.nodes[NODE].rejection is None
    # Whole-GPU pods only block enabling; an enabled node is re-configured.
    gwt(
        given=[enabled],
        when=ConfigureNode(
            node=NODE, policy_label="share-pool", gpu_count=16, exclusive_gpu_pods=("x",)
        ),
        then=[NodeConfigured(node=NODE, policy="share-pool", gpu_count=16)],
    )


def test_disabling() -> None:
    gwt(
        given=SHARE_NODE,
        when=ConfigureNode(node=NODE, policy_label="none"),
        then=[NodeDisabled(node=NODE)],
    )
    gwt(given=[], when=ConfigureNode(node=NODE, policy_label="none"), then=[])
    gwt(
        given=[*SHARE_NODE, NodeDisabled(node=NODE)],
        when=ConfigureNode(node=NODE, policy_label=None),
        then=[],
    )


def test_a_rejected_node_whose_label_is_removed_is_no_longer_invalid() -> None:
    bad = NodeRejected(node=NODE, reason="InvalidPolicy", message="...")
    state = gwt(
        given=[bad],
        when=ConfigureNode(node=NODE, policy_label="none"),
        then=[NodeDisabled(node=NODE)],
    )
    assert state.nodes[NODE].rejection is None and not state.nodes[NODE].enabled


def test_inventory_is_recorded_when_it_changes() -> None:
    report = ReportInventory(node=NODE, gpus=gpus(2), source="nvml")
    reported = GpuInventoryReported(node=NODE, gpus=gpus(2), source="nvml")
    gwt(given=[], when=report, then=[reported])
    gwt(given=[reported], when=report, then=[])
    gwt(
        given=[reported],
        when=ReportInventory(node=NODE, gpus=gpus(3), source="nvml"),
        then=[GpuInventoryReported(node=NODE, gpus=gpus(3), source="nvml")],
    )


@pytest.mark.parametrize(
    ("label", "expected"),
    [
        pytest.param("share-pool", "share-pool", id="share-pool"),
        pytest.param("static", "static", id="static"),
        pytest.param("none", None, id="none"),
        pytest.param(None, None, id="no-label"),
    ],
)
def test_validate_node_policy(label: str | None, expected: str | None) -> None:
    assert validate_node_policy(label) == expected


# --------------------------------------------------------------------------- QoS annotation


def test_the_source_documents_qos_annotation() -> None:
    assert parse_qos_annotation(SOURCE_QOS) == QosConfig(
        preempt_enabled=True,
        pod_max_duration_minutes=120,
        reserved_ephemeral_storage="1.5Ti",
        backfill=False,
        preempt_grace_seconds=10,
        waiting_message_period_seconds=10,
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(None, QosConfig(), id="missing"),
        pytest.param("  ", QosConfig(), id="blank"),
        pytest.param("{}", QosConfig(), id="empty-object"),
        pytest.param(
            '{"backfill": true, "preemptGracePeriodSeconds": 0, "waitingMessagePeriodSeconds": 30}',
            QosConfig(backfill=True, preempt_grace_seconds=0, waiting_message_period_seconds=30),
            id="our-keys",
        ),
    ],
)
def test_qos_defaults_and_our_keys(text: str | None, expected: QosConfig) -> None:
    assert parse_qos_annotation(text) == expected
    assert QosConfig().preempt_enabled is False and QosConfig().backfill is False


@pytest.mark.parametrize(
    ("text", "says"),
    [
        pytest.param('{"preemptEnabled": true,', "not valid JSON", id="bad-json"),
        pytest.param("[true]", "must be a JSON object, not list", id="not-an-object"),
        pytest.param('"preemptEnabled"', "must be a JSON object, not str", id="a-string"),
        pytest.param('{"preemptEnable": true}', "unknown key 'preemptEnable'", id="unknown-key"),
        pytest.param(
            '{"preemptEnabled": "true"}',
            'preemptEnabled must be a bool, not "true"',
            id="bool-as-string",
        ),
        pytest.param(
            '{"preemptEnabled": 1}', "preemptEnabled must be a bool, not 1", id="bool-as-number"
        ),
        pytest.param(
            '{"podMaxDurationMinutes": "120"}',
            "podMaxDurationMinutes must be an integer",
            id="minutes-as-string",
        ),
        pytest.param(
            '{"podMaxDurationMinutes": 1.5}',
            "podMaxDurationMinutes must be an integer",
            id="minutes-fraction",
        ),
        pytest.param(
            '{"podMaxDurationMinutes": true}',
            "podMaxDurationMinutes must be an integer",
            id="minutes-bool",
        ),
        pytest.param(
            '{"podMaxDurationMinutes": null}',
            "podMaxDurationMinutes must be an integer",
            id="minutes-null",
        ),
        pytest.param(
            '{"podMaxDurationMinutes": 0}',
            "podMaxDurationMinutes must be at least 1, not 0",
            id="minutes-0",
        ),
        pytest.param('{"podMaxDurationMinutes": -5}', "at least 1", id="minutes-negative"),
        pytest.param(
            '{"reservedEphemeralStorage": 1.5}',
            "reservedEphemeralStorage must be a str",
            id="storage-number",
        ),
        pytest.param(
            '{"reservedEphemeralStorage": "1.5TB"}',
            "is not a Kubernetes quantity",
            id="storage-bad-suffix",
        ),
        pytest.param(
            '{"reservedEphemeralStorage": "lots"}',
            "is not a Kubernetes quantity",
            id="storage-words",
        ),
        pytest.param(
            '{"reservedEphemeralStorage": "-1Ti"}',
            "is not a Kubernetes quantity",
            id="storage-negative",
        ),
        pytest.param('{"backfill": "yes"}', "backfill must be a bool", id="backfill-string"),
        pytest.param('{"preemptGracePeriodSeconds": -1}', "0 or more", id="grace-negative"),
        pytest.param('{"waitingMessagePeriodSeconds": 0}', "at least 1", id="period-0"),
    ],
)
def test_invalid_qos_annotations(text: str, says: str) -> None:
    rejection = parse_qos_annotation(text)
    assert isinstance(rejection, Rejection)
    assert rejection.reason == "InvalidQosConfig"
    assert says in rejection.message
    assert rejection.message.startswith("annotation alibabacloud.com/gpu-share-qos-config ")


# --------------------------------------------------------------------------- quantities


@pytest.mark.parametrize(
    ("text", "value"),
    [
        pytest.param("1.5Ti", Decimal(3) * 2**39, id="1.5Ti"),
        pytest.param("6Ti", Decimal(6) * 2**40, id="6Ti"),
        pytest.param("4608Gi", Decimal(4608) * 2**30, id="4608Gi"),
        pytest.param("1640Gi", Decimal(1640) * 2**30, id="1640Gi"),
        pytest.param("144", Decimal(144), id="plain"),
        pytest.param("500m", Decimal("0.5"), id="milli"),
        pytest.param("2k", Decimal(2000), id="decimal-suffix"),
        pytest.param("1.5G", Decimal(1_500_000_000), id="decimal-fraction"),
        pytest.param(".5Ki", Decimal(512), id="leading-dot"),
        pytest.param(" 10Mi ", Decimal(10 * 2**20), id="surrounding-space"),
    ],
)
def test_parse_quantity(text: str, value: Decimal) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "Ti", "1.5TB", "1,5Ti", "-1Gi", "1e3", "ten"])
def test_parse_quantity_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        parse_quantity(text)


@pytest.mark.parametrize(
    ("value", "binary", "text"),
    [
        pytest.param(Decimal(6) * 2**40, True, "6Ti", id="6Ti"),
        pytest.param(Decimal(3) * 2**39, True, "1536Gi", id="1.5Ti-is-1536Gi"),
        pytest.param(Decimal(4608) * 2**30, True, "4608Gi", id="4608Gi"),
        pytest.param(Decimal(0), True, "0", id="zero"),
        pytest.param(Decimal(1000), True, "1000", id="not-a-binary-multiple"),
        pytest.param(Decimal(1000), False, "1k", id="decimal"),
        pytest.param(Decimal(144), False, "144", id="plain"),
        pytest.param(Decimal("0.5"), False, "500m", id="milli"),
    ],
)
def test_format_quantity(value: Decimal, binary: bool, text: str) -> None:
    assert format_quantity(value, binary=binary) == text
    assert parse_quantity(text) == value


def test_reserved_storage_reduces_allocatable_as_in_the_source() -> None:
    # status.allocatable ephemeral-storage 4608Gi is 6Ti less the reserved 1.5Ti.
    assert format_quantity(parse_quantity("6Ti") - parse_quantity("1.5Ti")) == "4608Gi"


# --------------------------------------------------------------------------- coverage of reasons

CORE_SOURCE = Path(gpupool.core.__file__).parent


def test_every_rejection_reason_in_the_core_is_tested() -> None:
    in_code: set[str] = set()
    for module in ("validation.py", "decide.py", "input_bounds.py"):
        text = (CORE_SOURCE / module).read_text()
        in_code |= set(re.findall(r'(?:reason=|reject\(\s*)"([A-Z][A-Za-z]+)"', text))
    tested = {
        p.values[-1]
        for table in (POD_REJECTIONS, DECIDE_REJECTIONS, NODE_REJECTIONS)
        for p in table
    }
    tested.add("InvalidQosConfig")  # test_invalid_qos_annotations
    # tests/unit/test_input_poison.py: names and numbers the log cannot hold
    tested |= {"InvalidNodeName", "InvalidPodName", "InvalidPodUid", "InvalidPriority"}
    tested.add("InvalidGpuCount")
    assert len(in_code) >= 20
    assert in_code == tested
