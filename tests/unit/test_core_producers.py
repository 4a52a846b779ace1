"""An event is believed only from a writer that produces such events (gpupool.core.producers).

Issue 12: "events whose producer, pod or GPU does not exist are rejected as events
with a reason, never applied", and ``verify`` reports them. The producer is the
writer token of the entry's subject; the table is checked here against what
``decide`` emits for the commands each service executes, over every example
scenario, so a service's own events are never refused.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from core_gwt import NODE, at, gpu_uuid, node_events, ref, registered

from gpupool.cli.audit import verify
from gpupool.cli.scenario_file import load_scenario
from gpupool.core import (
    Command,
    ConfigureNode,
    PlanPreemption,
    ReconcilePods,
    RegisterPod,
    RemovePod,
    ReportInventory,
    ReportRelease,
    RequestGpu,
    Schedule,
)
from gpupool.core import simulation as simulation_module
from gpupool.core.producers import (
    LEGACY_TOKENS,
    PRODUCERS,
    UNATTRIBUTED_WRITERS,
    producer_problem,
)
from gpupool.eventlog.port import StoredEvent
from gpupool.eventlog.subjects import (
    DEFAULT_WRITER,
    SIMULATOR_WRITER,
    WRITERS,
    node_entry_subject,
)
from gpupool.events import (
    ALL_EVENT_TYPES,
    Assigned,
    Envelope,
    Event,
    MessageRejected,
    PodReady,
    Preempted,
)
from gpupool.runtime.projection import Projection

ROOT = Path(__file__).resolve().parents[2]

EXECUTED_BY: dict[type[Command], str] = {
    # services/policy: nodes and pods from Kubernetes or the cluster file
    ConfigureNode: "policy",
    RegisterPod: "policy",
    RemovePod: "policy",
    ReconcilePods: "policy",
    # services/admission_queue, services/preemption
    Schedule: "admission-queue",
    PlanPreemption: "preemption",
    # services/node_executor: its inventory, its clients' requests and exits
    ReportInventory: "node-executor",
    RequestGpu: "node-executor",
    ReportRelease: "node-executor",
}


def envelope(event: Event) -> Envelope:
    return Envelope(id=uuid.uuid4().hex, time=at(0), event=event)


def test_the_writers_are_the_logs_writers() -> None:
    assert set(PRODUCERS) == set(WRITERS)
    assert {DEFAULT_WRITER, SIMULATOR_WRITER} == UNATTRIBUTED_WRITERS
    for events in PRODUCERS.values():
        assert MessageRejected in events  # every service sets aside what it cannot read


def test_each_service_produces_what_decide_emits_for_its_commands(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    emitted: dict[str, set[type[Event]]] = {writer: set() for writer in WRITERS}
    decide = simulation_module.decide

    def checked(state: object, command: Command, now: object) -> list[Event]:
        events = decide(state, command, now)  # type: ignore[arg-type]
        writer = EXECUTED_BY[type(command)]
        for event in events:
            assert producer_problem(event, writer) is None, (command, event)
            emitted[writer].add(type(event))
        return events

    def scheduled(state: object, node: str, now: object) -> list[Event]:
        return checked(state, Schedule(node=node), now)

    def planned(state: object, node: str, now: object) -> list[Event]:
        return checked(state, PlanPreemption(node=node), now)

    monkeypatch.setattr(simulation_module, "decide", checked)
    # the simulator settles a node by calling decide's Schedule and PlanPreemption directly
    monkeypatch.setattr(simulation_module, "schedule", scheduled)
    monkeypatch.setattr(simulation_module, "plan_node_preemption", planned)
    scenarios = sorted((ROOT / "scenarios").glob("*.yaml"))
    assert len(scenarios) >= 5
    for path in scenarios:
        simulation_module.simulate(load_scenario(path))
    # the scenarios exercise the table: each service's main events were emitted
    assert Assigned in emitted["admission-queue"]
    assert Preempted in emitted["preemption"]
    assert PodReady in emitted["node-executor"]
    assert Assigned in emitted["policy"]  # a static pod bound at registration


def test_an_event_from_another_service_is_refused_with_the_reason() -> None:
    assigned = Assigned(pod=ref("a"), node=NODE, gpu_index=0, gpu_uuid=gpu_uuid(0))
    assert producer_problem(assigned, "admission-queue") is None
    problem = producer_problem(assigned, "preemption")
    assert problem == (
        "WrongProducer: Assigned is appended only by policy, admission-queue, "
        "node-executor, not by preemption"
    )
    preempted = Preempted(
        victim=ref("v"),
        preemptor=ref("p"),
        node=NODE,
        gpu_index=0,
        gpu_uuid=gpu_uuid(0),
        reason="priority",
    )
    wrong = producer_problem(preempted, "node-executor")
    assert wrong == "WrongProducer: Preempted is appended only by preemption, not by node-executor"
    assert producer_problem(PodReady(pod=ref("a"), node=NODE), "policy") is not None
    unknown = producer_problem(assigned, "intruder")
    assert unknown is not None and unknown.startswith("UnknownProducer: Assigned")


def test_unattributed_and_legacy_subjects_read_as_before() -> None:
    for event_type in ALL_EVENT_TYPES:
        assert event_type.__struct_config__.tag in LEGACY_TOKENS
    assigned = Assigned(pod=ref("a"), node=NODE, gpu_index=0, gpu_uuid=gpu_uuid(0))
    for writer in (None, DEFAULT_WRITER, SIMULATOR_WRITER, "Assigned", "Decision", "PodReady"):
        assert producer_problem(assigned, writer) is None, writer


SETUP_WRITERS = ("node-executor", "policy", "policy", "node-executor")
"""The writers of the inventory, the node, the pod's registration and its PodReady."""


def setup_events() -> list[Event]:
    return [*node_events(1), registered("a", 50), PodReady(pod=ref("a"), node=NODE)]


def test_the_projection_records_the_refusal_and_applies_nothing() -> None:
    projection = Projection()
    for seq, (event, writer) in enumerate(zip(setup_events(), SETUP_WRITERS, strict=True), 1):
        assert projection.apply(seq, envelope(event), writer=writer)
    assert projection.take_refused() == []
    forged = envelope(Assigned(pod=ref("a"), node=NODE, gpu_index=0, gpu_uuid=gpu_uuid(0)))
    assert projection.apply(5, forged, writer="preemption")  # its sequence is passed
    (refused,) = projection.take_refused()
    assert refused.seq == 5 and refused.reason.startswith("WrongProducer: Assigned")
    assert projection.state.pods[ref("a")].phase == "ready"  # not running
    assert projection.last_seq == 5
    # the same envelope from the admission-queue is believed
    assert projection.apply(6, forged, writer="admission-queue")
    assert projection.take_refused() == []
    assert projection.state.pods[ref("a")].phase == "running"


def test_verify_reports_an_event_from_the_wrong_writer() -> None:
    entries = [
        StoredEvent(seq=seq, subject=node_entry_subject(NODE, writer=writer), envelope=envelope(e))
        for seq, (e, writer) in enumerate(zip(setup_events(), SETUP_WRITERS, strict=True), 1)
    ]
    waiting = verify(entries)  # a ready pod waits while a GPU has room: a liveness finding
    assert waiting.set_aside == [] and [v.seq for v in waiting.violations] == [4]
    assigned = Assigned(pod=ref("a"), node=NODE, gpu_index=0, gpu_uuid=gpu_uuid(0))
    forged = StoredEvent(
        seq=5, subject=node_entry_subject(NODE, writer="preemption"), envelope=envelope(assigned)
    )
    report = verify([*entries, forged])
    assert [(item.seq, item.reason.split(":")[0]) for item in report.set_aside] == [
        (5, "WrongProducer")
    ]
    assert [(item.seq, item.message.split(":")[0]) for item in report.violations] == [
        (4, waiting.violations[0].message.split(":")[0]),  # still waiting: nothing believed it
        (5, "WrongProducer"),
    ]
    assert report.assignments == 0
    # from the admission-queue it is an ordinary assignment
    believed = StoredEvent(
        seq=5, subject=node_entry_subject(NODE, writer="admission-queue"), envelope=forged.envelope
    )
    fine = verify([*entries, believed])
    assert fine.set_aside == [] and fine.violations == [] and fine.assignments == 1
