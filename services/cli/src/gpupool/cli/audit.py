"""``gpupool verify``'s check of every invariant, as a pure function over the entries of a log.

The other audit read models (log selection, pod histories, states at a moment, GPU
intervals, preemptions, wait estimates, explanations) live in the ``gpupool.audit``
library, which the CLI commands and the web console render. ``verify`` folds the
log with the same core ``evolve`` the services use (through
:class:`~gpupool.runtime.projection.Projection`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import msgspec

from gpupool.audit.describe import share_text
from gpupool.audit.state import node_usage as _usage
from gpupool.cli.times import format_duration
from gpupool.core import NodeState, PodState, State, gpu_usage, queue_positions, ready_queue
from gpupool.core.admission_check import REPLAYED, WRONG_NODE
from gpupool.core.placement import allocated_requests, fits, reservation_gpu
from gpupool.core.producers import UNKNOWN_PRODUCER, WRONG_PRODUCER, producer_problem
from gpupool.core.state import GPU_PERCENT
from gpupool.core.verification import RULES as LIVENESS_RULES
from gpupool.core.verification import check_liveness_and_optimality
from gpupool.eventlog.port import Entry, StoredEvent, Undecodable
from gpupool.eventlog.subjects import writer_of_subject
from gpupool.events import (
    Assigned,
    Envelope,
    PodReady,
    PodRef,
    PodRegistered,
    PodRemoved,
    Preempted,
    Released,
    Share,
    event_pod,
    event_tag,
)
from gpupool.runtime.projection import Projection

# --------------------------------------------------------------------------- gpupool verify


class Violation(msgspec.Struct, frozen=True, kw_only=True):
    """An entry that breaks an invariant: which one (seq, id, type, pod) and how."""

    seq: int
    id: str
    type: str
    pod: str
    message: str


class SetAside(msgspec.Struct, frozen=True, kw_only=True):
    """An entry the services do not fold: unreadable, or not believed (admission_check)."""

    seq: int
    reason: str


class VerifyReport(msgspec.Struct, kw_only=True):
    entries: int = 0
    undecodable: int = 0
    nodes: int = 0
    pods: int = 0
    assignments: int = 0
    preemptions: int = 0
    releases: int = 0
    violations: list[Violation] = []
    set_aside: list[SetAside] = []
    """Every entry not folded, with why (the services record each as a MessageRejected)."""

    @property
    def ok(self) -> bool:
        return not self.violations


INVARIANTS = (
    "no GPU over 100% by limits (core and memory; static pods by requests)",
    "no double assignment (a pod assigned while it holds a GPU)",
    "the queue is served in order (only the head is assigned, or with backfill a later pod "
    "on a GPU not reserved for the head)",
    "a pod is ready only from dormant, and assigned only from the queue",
    "every Preempted is followed by its victim's release; no release as preempted without one",
    "no pod is preempted for a pod of lower priority",
    "the requests of a node's pods stay within its allocatable",
    "no envelope is applied twice (an entry appended again under a new message id)",
    *LIVENESS_RULES,
)
"""What ``verify`` checks, in the words its summary uses."""


def _gpu_problem(
    node: NodeState, pods: list[PodState], pod: PodState, gpu_index: int
) -> str | None:
    """Why ``pod`` may not take a slot on ``gpu_index`` (over 100, or no such GPU)."""
    if node.gpus and gpu_index not in {gpu.index for gpu in node.gpus}:
        return f"node {node.name} has no GPU {gpu_index}"
    usage, basis = _usage(node, pods)
    want = pod.requests if basis == "requests" else pod.limits
    used = usage.get(gpu_index, Share(core=0, memory=0))
    if fits(used, want):
        return None
    holders = [
        f"{other.ref} {share_text(other.requests if basis == 'requests' else other.limits)}"
        for other in pods
        if other.gpu_index == gpu_index
        and other.ref != pod.ref
        and (basis == "requests" or other.phase == "running")
    ]
    total = Share(core=used.core + want.core, memory=used.memory + want.memory)
    return (
        f"GPU {gpu_index} of {node.name} would hold {share_text(total)} by {basis}, over "
        f"{GPU_PERCENT}%: {' + '.join([*holders, f'{pod.ref} {share_text(want)}'])}"
    )


class _Verifier:
    def __init__(self) -> None:
        self.report = VerifyReport()
        self.open_preemptions: dict[PodRef, StoredEvent] = {}
        self.projection = Projection()

    def violation(self, entry: StoredEvent, pod: str, message: str) -> None:
        self.report.violations.append(
            Violation(
                seq=entry.seq,
                id=entry.envelope.id,
                type=event_tag(entry.envelope.event),
                pod=pod,
                message=message,
            )
        )

    def check(self, entry: StoredEvent) -> None:
        state = self.projection.state
        event = entry.envelope.event
        match event:
            case PodRegistered():
                self._registered(entry, event, state)
            case PodReady():
                pod = state.pods.get(event.pod)
                if pod is None:
                    self.violation(entry, str(event.pod), f"{event.pod} is not registered")
                elif pod.phase != "dormant":
                    self.violation(
                        entry, str(event.pod), f"{event.pod} became ready while {pod.phase}"
                    )
            case Assigned():
                self.report.assignments += 1
                self._assigned(entry, event, state)
            case Preempted():
                self.report.preemptions += 1
                self._preempted(entry, event, state)
            case Released():
                self.report.releases += 1
                self._released(entry, event, state)
            case PodRemoved():
                self.open_preemptions.pop(event.pod, None)
            case _:
                pass

    def _registered(self, entry: StoredEvent, event: PodRegistered, state: State) -> None:
        name = str(event.pod)
        if event.pod in state.pods:
            self.violation(entry, name, f"{event.pod} is already registered")
            return
        node = state.nodes.get(event.node)
        if node is None or node.policy != event.policy:
            policy = "not enabled" if node is None or node.policy is None else node.policy
            self.violation(
                entry, name, f"{event.policy} pod registered on {event.node}, which is {policy}"
            )
            return
        total = allocated_requests(state.pods_on(event.node))
        core, memory = total.core + event.requests.core, total.memory + event.requests.memory
        allocatable = node.allocatable_percent
        if core > allocatable or memory > allocatable:
            self.violation(
                entry,
                name,
                f"requests on {event.node} reach core {core}% memory {memory}%, over its "
                f"allocatable {allocatable}%",
            )

    def _assigned(self, entry: StoredEvent, event: Assigned, state: State) -> None:
        name = str(event.pod)
        pod = state.pods.get(event.pod)
        if pod is None:
            self.violation(entry, name, f"{event.pod} is not registered")
            return
        if pod.node != event.node:
            self.violation(
                entry, name, f"{event.pod} is registered on {pod.node}, not {event.node}"
            )
            return
        if pod.policy == "static" and pod.phase == "dormant" and pod.gpu_index == event.gpu_index:
            return  # a static pod runs again on the GPU it stays bound to: no new capacity
        if pod.gpu_index is not None:
            self.violation(
                entry,
                name,
                f"double assignment: {event.pod} already holds GPU {pod.gpu_index} "
                f"(assigned again to GPU {event.gpu_index})",
            )
            return
        node = state.node(event.node)
        pods = state.pods_on(event.node)
        problem = _gpu_problem(node, pods, pod, event.gpu_index)
        if problem is not None:
            self.violation(entry, name, problem)
        if pod.policy == "static":
            return
        if pod.phase != "ready":
            self.violation(entry, name, f"{event.pod} was assigned while {pod.phase}, not ready")
            return
        head = ready_queue(state, event.node)[0]
        if head.ref == event.pod:
            return
        position = queue_positions(state, event.node)[event.pod]
        if not node.qos.backfill:
            self.violation(
                entry,
                name,
                f"out of order: {event.pod} was at position {position}; the head was "
                f"{head.ref} and backfill is off on {event.node}",
            )
            return
        reserved = reservation_gpu(gpu_usage(node, pods), head, pods)
        if reserved == event.gpu_index:
            self.violation(
                entry,
                name,
                f"backfill onto GPU {reserved}, which is reserved for the head {head.ref} "
                f"({event.pod} was at position {position})",
            )

    def _preempted(self, entry: StoredEvent, event: Preempted, state: State) -> None:
        name = str(event.victim)
        victim = state.pods.get(event.victim)
        preemptor = state.pods.get(event.preemptor)
        if victim is None or victim.phase != "running" or victim.gpu_index != event.gpu_index:
            where = "not registered" if victim is None else f"{victim.phase}"
            if victim is not None and victim.gpu_index is not None:
                where += f" on GPU {victim.gpu_index}"
            self.violation(
                entry,
                name,
                f"victim {event.victim} is not running on GPU {event.gpu_index} ({where})",
            )
        elif victim.policy == "static":
            self.violation(entry, name, f"victim {event.victim} is a static pod")
        if preemptor is None or preemptor.phase != "ready":
            phase = "not registered" if preemptor is None else preemptor.phase
            self.violation(entry, name, f"preemptor {event.preemptor} is not waiting ({phase})")
        elif victim is not None and victim.priority > preemptor.priority:
            self.violation(
                entry,
                name,
                f"{event.victim} (priority {victim.priority}) preempted for {event.preemptor} "
                f"of lower priority {preemptor.priority}",
            )
        self.open_preemptions[event.victim] = entry

    def _released(self, entry: StoredEvent, event: Released, state: State) -> None:
        name = str(event.pod)
        pod = state.pods.get(event.pod)
        opened = self.open_preemptions.get(event.pod)
        if opened is not None:
            preempted = opened.envelope.event
            assert isinstance(preempted, Preempted)
            # The victim gives up the GPU it was preempted on (it may finish on its own first).
            if event.reason == "preempted" or event.gpu_index == preempted.gpu_index:
                del self.open_preemptions[event.pod]
        elif event.reason == "preempted":
            self.violation(
                entry, name, f"{event.pod} released as preempted, but no Preempted names it"
            )
        if pod is None:
            self.violation(entry, name, f"{event.pod} is not registered")
            return
        if event.gpu_index is None:
            if pod.phase != "ready":
                self.violation(entry, name, f"{event.pod} left the queue while {pod.phase}")
        elif pod.gpu_index != event.gpu_index or (
            pod.phase != "running"
            and not (pod.policy == "static" and event.reason == "gpu-vanished")
        ):
            held = "no GPU" if pod.gpu_index is None else f"GPU {pod.gpu_index}"
            self.violation(
                entry, name, f"{event.pod} released GPU {event.gpu_index} but holds {held}"
            )

    def finish(self, last: StoredEvent | None) -> None:
        for victim, opened in self.open_preemptions.items():
            event = opened.envelope.event
            assert isinstance(event, Preempted)
            ends = (
                f"; the log ends {format_duration(last.envelope.time - opened.envelope.time)} later"
                if last is not None
                else ""
            )
            self.violation(
                opened,
                str(victim),
                f"{victim} was preempted for {event.preemptor} but never released{ends}",
            )
        state = self.projection.state
        self.report.nodes = len(state.nodes)


def verify(entries: Sequence[Entry]) -> VerifyReport:
    """Fold the whole log and check :data:`INVARIANTS` at every entry."""
    verifier = _Verifier()
    report = verifier.report
    last: StoredEvent | None = None
    pods: set[PodRef] = set()
    for entry in entries:
        report.entries += 1
        if isinstance(entry, Undecodable):
            report.undecodable += 1
            report.set_aside.append(SetAside(seq=entry.seq, reason=entry.error))
            verifier.projection.skip(entry.seq, None)
            continue
        writer = writer_of_subject(entry.subject)
        if producer_problem(entry.envelope.event, writer) is None:
            verifier.check(entry)  # (an event from the wrong writer is a violation below)
        verifier.projection.apply(
            entry.seq, entry.envelope, index=entry.index, last=entry.last, writer=writer
        )
        for refused in verifier.projection.take_refused():
            report.set_aside.append(SetAside(seq=refused.seq, reason=refused.reason))
            # the other refusals (admission_check) break an invariant checked above already
            if refused.reason.startswith((REPLAYED, UNKNOWN_PRODUCER, WRONG_PRODUCER, WRONG_NODE)):
                pod = event_pod(refused.envelope.event)
                verifier.violation(entry, "" if pod is None else str(pod), refused.reason)
        if isinstance(entry.envelope.event, PodRegistered):
            pods.add(entry.envelope.event.pod)
        last = entry
    report.pods = len(pods)
    verifier.finish(last)
    report.violations.extend(
        Violation(
            seq=finding.seq,
            id=finding.envelope_id,
            type=finding.type,
            pod=finding.pod,
            message=finding.message,
        )
        for finding in check_liveness_and_optimality(decision_entries(believed(entries)))
    )
    report.violations.sort(key=lambda violation: violation.seq)
    return report


def stored_events(entries: Iterable[Entry]) -> list[StoredEvent]:
    return [entry for entry in entries if isinstance(entry, StoredEvent)]


def believed(entries: Iterable[Entry]) -> list[StoredEvent]:
    """The stored events whose writer produces such events (the others are set aside)."""
    return [
        entry
        for entry in stored_events(entries)
        if producer_problem(entry.envelope.event, writer_of_subject(entry.subject)) is None
    ]


def decision_entries(events: Iterable[StoredEvent]) -> Iterator[tuple[int, list[Envelope]]]:
    """The envelopes of each log entry, grouped by sequence (a decision entry holds several)."""
    seq: int | None = None
    group: list[Envelope] = []
    for entry in events:
        if entry.seq != seq and group:
            assert seq is not None
            yield seq, group
            group = []
        seq = entry.seq
        group.append(entry.envelope)
    if group and seq is not None:
        yield seq, group
