"""What the audit commands compute, as pure functions over the entries of a log.

No I/O here: the commands read the log (``log_source``), call these functions and
print what they return. Every function folds the log with the same core
``evolve`` the services use (through :class:`~gpupool.runtime.projection.Projection`),
so an audit sees exactly the state the services saw.

* :func:`select_entries` — ``gpupool log``: filter entries by pod, node, type, time.
* :func:`pod_history` — ``gpupool history``: one pod's timeline, with its queue positions.
* :func:`state_at` — ``gpupool state --at``: queues and GPU occupancy at a past moment.
* :func:`verify` — ``gpupool verify``: every invariant, checked event by event.
* :func:`explain` — ``gpupool explain``: why a waiting pod waits, and for how long it may.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime, timedelta

import msgspec

from gpupool.cli.exits import InvalidInput
from gpupool.cli.times import format_duration, format_offset
from gpupool.core import NodeState, PodState, State, gpu_usage, queue_positions, ready_queue
from gpupool.core.placement import (
    GpuUsage,
    allocated_requests,
    fits,
    reservation_gpu,
    static_usage,
)
from gpupool.core.preemption import next_preemption_check, plan_preemption
from gpupool.core.state import GPU_PERCENT
from gpupool.core.verification import RULES as LIVENESS_RULES
from gpupool.core.verification import check_liveness_and_optimality
from gpupool.eventlog.port import Entry, StoredEvent, Undecodable
from gpupool.events import (
    Assigned,
    Envelope,
    Event,
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
    event_tag,
)
from gpupool.runtime.projection import Projection

DEFAULT_NAMESPACE = "default"
UNDECODABLE_TYPE = "Undecodable"
"""The type ``gpupool log`` shows for an entry whose bytes are not an envelope."""
RECENT_HOLDS = 20
"""How many of a node's most recent completed assignments the wait estimate looks at."""


class AuditError(InvalidInput, ValueError):
    """The question cannot be answered from this log (unknown pod or node, empty log)."""


# --------------------------------------------------------------------------- basics


def parse_pod(text: str) -> PodRef:
    """``NAMESPACE/NAME``, or ``NAME`` in the default namespace."""
    namespace, _, name = text.rpartition("/")
    if not name or "/" in namespace:
        raise AuditError(f"{text!r} is not a pod (NAMESPACE/NAME or NAME)")
    return PodRef(namespace=namespace or DEFAULT_NAMESPACE, name=name)


def stored_events(entries: Iterable[Entry]) -> list[StoredEvent]:
    return [entry for entry in entries if isinstance(entry, StoredEvent)]


def log_origin(entries: Iterable[Entry]) -> datetime | None:
    """The time of the first readable entry: offsets like ``+65s`` count from it."""
    for entry in entries:
        if isinstance(entry, StoredEvent):
            return entry.envelope.time
    return None


def involves(event: Event, pod: PodRef) -> bool:
    """Whether the event is about the pod (as the victim or the preemptor of a Preempted too)."""
    if isinstance(event, Preempted):
        return pod in (event.victim, event.preemptor)
    return getattr(event, "pod", None) == pod


def share_text(share: Share) -> str:
    return f"core {share.core}% memory {share.memory}%"


def qos_text(qos: QosConfig) -> str:
    if qos.preempt_enabled:
        limit = (
            f"podMaxDurationMinutes {qos.pod_max_duration_minutes}"
            if qos.pod_max_duration_minutes is not None
            else "no podMaxDurationMinutes"
        )
        preemption = f"preemption on ({limit}, grace {qos.preempt_grace_seconds}s)"
    else:
        preemption = "preemption off"
    return f"{preemption}, backfill {'on' if qos.backfill else 'off'}"


def event_pod_column(event: Event) -> str:
    """The pod a log line is about (the victim, for Preempted), or empty."""
    if isinstance(event, Preempted):
        return str(event.victim)
    pod = getattr(event, "pod", None)
    return str(pod) if isinstance(pod, PodRef) else ""


def event_details(event: Event) -> str:
    """One line saying what the event records, for ``gpupool log``."""
    match event:
        case NodeConfigured():
            gpus = f", {event.gpu_count} GPUs" if event.gpu_count else ""
            return f"policy {event.policy}{gpus}, {qos_text(event.qos)}"
        case NodeDisabled():
            return "GPU sharing disabled (policy none)"
        case NodeRejected() | PodRejected():
            return f"{event.reason}: {event.message}"
        case GpuInventoryReported():
            indexes = ", ".join(str(gpu.index) for gpu in event.gpus)
            return f"{len(event.gpus)} GPUs ({event.source}): {indexes}"
        case PodRegistered():
            return (
                f"{event.policy}, requests {share_text(event.requests)}, "
                f"limits {share_text(event.limits)}, priority {event.priority}"
            )
        case PodReady():
            return "joins the ready queue"
        case Assigned():
            return f"GPU {event.gpu_index} ({event.gpu_uuid})"
        case Preempted():
            return f"for {event.preemptor} on GPU {event.gpu_index}, reason {event.reason}"
        case Released():
            exit_code = "" if event.exit_code is None else f", exit code {event.exit_code}"
            where = "left the ready queue" if event.gpu_index is None else f"GPU {event.gpu_index}"
            return f"{event.reason}, {where}{exit_code}"
        case PodRemoved():
            return "deleted"
        case MessageRejected():
            return f"{event.subject}: {event.reason}"


# --------------------------------------------------------------------------- gpupool log


class LogFilter(msgspec.Struct, frozen=True, kw_only=True):
    pod: PodRef | None = None
    node: str | None = None
    types: frozenset[str] = frozenset()
    since: datetime | None = None
    until: datetime | None = None


def entry_matches(entry: Entry, selection: LogFilter) -> bool:
    """Undecodable entries have no time, node or pod: they match only filters by type or none."""
    if isinstance(entry, Undecodable):
        if selection.pod is not None or selection.node is not None:
            return False
        return not selection.types or UNDECODABLE_TYPE in selection.types
    envelope = entry.envelope
    event = envelope.event
    if selection.types and event_tag(event) not in selection.types:
        return False
    if selection.node is not None and event.node != selection.node:
        return False
    if selection.pod is not None and not involves(event, selection.pod):
        return False
    if selection.since is not None and envelope.time < selection.since:
        return False
    return selection.until is None or envelope.time <= selection.until


def select_entries(entries: Iterable[Entry], selection: LogFilter) -> list[Entry]:
    return [entry for entry in entries if entry_matches(entry, selection)]


# --------------------------------------------------------------------------- folding


class Hold(msgspec.Struct, frozen=True, kw_only=True):
    """One finished assignment: how long a pod held its GPU and why it let go."""

    pod: PodRef
    node: str
    gpu_index: int
    reason: str
    released_at: datetime
    held: timedelta


class Folded(msgspec.Struct, kw_only=True):
    """A log prefix folded: the projection, the last entry applied, what it saw on the way."""

    projection: Projection
    last: StoredEvent | None = None
    entries: int = 0
    holds: list[Hold] = []

    @property
    def state(self) -> State:
        return self.projection.state


def _record_hold(folded: Folded, state: State, envelope: Envelope) -> None:
    event = envelope.event
    if not isinstance(event, Released) or event.gpu_index is None:
        return
    pod = state.pods.get(event.pod)
    if pod is None or pod.running_since is None:
        return
    folded.holds.append(
        Hold(
            pod=event.pod,
            node=event.node,
            gpu_index=event.gpu_index,
            reason=event.reason,
            released_at=envelope.time,
            held=envelope.time - pod.running_since,
        )
    )


def fold_until(entries: Sequence[Entry], until: datetime | None = None) -> Folded:
    """Fold the log up to ``until``: the prefix that ends before the first entry after it.

    The log's order is the truth; times only pick where the prefix ends (entries
    with the same time as ``until`` are included).
    """
    folded = Folded(projection=Projection())
    folded.projection.observers.append(
        lambda state, envelope, _seq: _record_hold(folded, state, envelope)
    )
    for entry in entries:
        if isinstance(entry, Undecodable):
            folded.projection.skip(entry.seq, None)
            folded.entries += 1
            continue
        if until is not None and entry.envelope.time > until:
            break
        folded.projection.apply(entry.seq, entry.envelope, index=entry.index, last=entry.last)
        folded.last = entry
        folded.entries += 1
    return folded


# --------------------------------------------------------------------------- gpupool history


class HistoryLine(msgspec.Struct, frozen=True, kw_only=True):
    seq: int
    time: datetime
    text: str


class History(msgspec.Struct, frozen=True, kw_only=True):
    pod: PodRef
    node: str
    origin: datetime
    lines: list[HistoryLine]


def _cause(event: Event) -> str:
    """Why the queue changed, seen from a pod waiting in it."""
    match event:
        case Assigned():
            return f"{event.pod} left the queue (assigned GPU {event.gpu_index})"
        case PodReady():
            return f"{event.pod} joined the queue"
        case Released() if event.gpu_index is None:
            return f"{event.pod} left the queue ({event.reason})"
        case PodRemoved():
            return f"{event.pod} was removed"
    return f"{event_tag(event)} {event_pod_column(event)}".rstrip()


class _Wait:
    def __init__(self, since: datetime, position: int) -> None:
        self.since = since
        self.positions = [position]


def pod_history(entries: Sequence[Entry], pod: PodRef) -> History:
    """Every step of one pod: registered, ready (position), position changes, GPU, preemptions, releases, removal."""
    origin = log_origin(entries)
    projection = Projection()
    lines: list[HistoryLine] = []
    node = ""
    wait: _Wait | None = None
    for entry in entries:
        if isinstance(entry, Undecodable):
            projection.skip(entry.seq, None)
            continue
        envelope = entry.envelope
        event = envelope.event
        before = projection.state.pods.get(pod)
        held_since = before.running_since if before is not None else None
        projection.apply(entry.seq, envelope, index=entry.index, last=entry.last)
        state = projection.state
        mine = involves(event, pod)
        if isinstance(event, PodRegistered | PodRejected) and event.pod == pod:
            node = event.node
        if not mine and (wait is None or event.node != node):
            continue

        def say(text: str, entry: StoredEvent = entry) -> None:
            lines.append(HistoryLine(seq=entry.seq, time=entry.envelope.time, text=text))

        now = envelope.time
        match event:
            case PodRegistered() if mine:
                say(
                    f"registered on {event.node}: {event.policy}, requests "
                    f"{share_text(event.requests)}, limits {share_text(event.limits)}, "
                    f"priority {event.priority}"
                )
            case PodRejected() if mine:
                say(f"rejected, {event.reason}: {event.message}")
            case PodReady() if mine:
                positions = queue_positions(state, event.node)
                position = positions.get(pod, 0)
                wait = _Wait(now, position)
                say(f"ready: joins the queue at position {position} of {len(positions)}")
            case Assigned() if mine:
                if wait is None:
                    say(f"bound to GPU {event.gpu_index} ({event.gpu_uuid}) at admission (static)")
                else:
                    where = ", ".join(str(p) for p in wait.positions)
                    plural = "s" if len(wait.positions) > 1 else ""
                    say(
                        f"assigned GPU {event.gpu_index} ({event.gpu_uuid}) after waiting "
                        f"{format_duration(now - wait.since)} at position{plural} {where}"
                    )
                wait = None
            case Preempted() if event.victim == pod:
                held = (
                    f" after holding it {format_duration(now - held_since)}" if held_since else ""
                )
                say(
                    f"preempted by {event.preemptor} on GPU {event.gpu_index} "
                    f"(reason {event.reason}){held}"
                )
            case Preempted() if event.preemptor == pod:
                say(f"preempts {event.victim} on GPU {event.gpu_index} (reason {event.reason})")
            case Released() if mine:
                exit_code = "" if event.exit_code is None else f" (exit code {event.exit_code})"
                if event.gpu_index is None:
                    waited = f" after waiting {format_duration(now - wait.since)}" if wait else ""
                    say(f"left the queue: {event.reason}{waited}")
                else:
                    held = (
                        f" after holding it {format_duration(now - held_since)}"
                        if held_since
                        else ""
                    )
                    say(f"released GPU {event.gpu_index}: {event.reason}{exit_code}{held}")
                wait = None
            case PodRemoved() if mine:
                was = (
                    f" (it was {before.phase})"
                    if before is not None and before.phase != "dormant"
                    else ""
                )
                say(f"removed: the pod was deleted{was}")
                wait = None
            case _ if wait is not None and event.node == node:
                positions = queue_positions(state, node)
                moved_to = positions.get(pod)
                if moved_to is not None and moved_to != wait.positions[-1]:
                    say(
                        f"position {moved_to} of {len(positions)} (was {wait.positions[-1]}): "
                        f"{_cause(event)}"
                    )
                    wait.positions.append(moved_to)
    if origin is None or not lines:
        raise AuditError(f"pod {pod} does not appear in the log")
    return History(pod=pod, node=node, origin=origin, lines=lines)


# --------------------------------------------------------------------------- gpupool state --at


class PodSlot(msgspec.Struct, frozen=True, kw_only=True):
    """A pod holding a slot on a GPU."""

    pod: PodRef
    policy: str
    requests: Share
    limits: Share
    priority: int
    since: datetime | None
    evicted_by: PodRef | None = None
    evict_reason: str | None = None


class GpuView(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    uuid: str
    used: Share
    """Sum over the pods holding it: of limits (share-pool), of requests (static)."""
    basis: str
    pods: list[PodSlot]


class QueuedPod(msgspec.Struct, frozen=True, kw_only=True):
    position: int
    pod: PodRef
    priority: int
    limits: Share
    ready_since: datetime | None


class NodeView(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    policy: str | None
    qos: QosConfig
    inventory_source: str | None
    gpus: list[GpuView]
    queue: list[QueuedPod]
    dormant: list[PodRef]
    requested: Share
    allocatable: int
    rejection: tuple[str, str] | None


class StateView(msgspec.Struct, frozen=True, kw_only=True):
    at: datetime
    origin: datetime
    last: StoredEvent | None
    entries: int
    nodes: list[NodeView]


def _usage(node: NodeState, pods: list[PodState]) -> tuple[GpuUsage, str]:
    if node.policy == "static":
        return static_usage(node, pods), "requests"
    return gpu_usage(node, pods), "limits"


def node_view(state: State, name: str) -> NodeView:
    node = state.nodes[name]
    pods = state.pods_on(name)
    usage, basis = _usage(node, pods)
    uuids = {gpu.index: gpu.uuid for gpu in node.gpus}
    holders: dict[int, list[PodSlot]] = {}
    for pod in pods:
        if pod.gpu_index is not None:
            holders.setdefault(pod.gpu_index, []).append(
                PodSlot(
                    pod=pod.ref,
                    policy=pod.policy,
                    requests=pod.requests,
                    limits=pod.limits,
                    priority=pod.priority,
                    since=pod.running_since,
                    evicted_by=pod.evicted_by,
                    evict_reason=pod.evict_reason,
                )
            )
    indexes = sorted(set(usage) | set(holders))
    gpus = [
        GpuView(
            index=index,
            uuid=uuids.get(index, ""),
            used=usage.get(index, Share(core=0, memory=0)),
            basis=basis,
            pods=holders.get(index, []),
        )
        for index in indexes
    ]
    queue = [
        QueuedPod(
            position=position,
            pod=pod.ref,
            priority=pod.priority,
            limits=pod.limits,
            ready_since=pod.ready_since,
        )
        for position, pod in enumerate(ready_queue(state, name), start=1)
    ]
    dormant = [pod.ref for pod in pods if pod.phase == "dormant" and pod.gpu_index is None]
    return NodeView(
        name=name,
        policy=node.policy,
        qos=node.qos,
        inventory_source=node.inventory_source,
        gpus=gpus,
        queue=queue,
        dormant=dormant,
        requested=allocated_requests(pods),
        allocatable=node.allocatable_percent,
        rejection=node.rejection,
    )


def state_at(entries: Sequence[Entry], at: datetime, node: str | None = None) -> StateView:
    origin = log_origin(entries)
    if origin is None:
        raise AuditError("the log has no readable entries")
    folded = fold_until(entries, at)
    names = sorted(folded.state.nodes)
    if node is not None:
        if node not in folded.state.nodes:
            known = ", ".join(names) or "none"
            raise AuditError(f"node {node!r} is not in the log at that time (nodes: {known})")
        names = [node]
    return StateView(
        at=at,
        origin=origin,
        last=folded.last,
        entries=folded.entries,
        nodes=[node_view(folded.state, name) for name in names],
    )


# --------------------------------------------------------------------------- gpupool verify


class Violation(msgspec.Struct, frozen=True, kw_only=True):
    """An entry that breaks an invariant: which one (seq, id, type, pod) and how."""

    seq: int
    id: str
    type: str
    pod: str
    message: str


class VerifyReport(msgspec.Struct, kw_only=True):
    entries: int = 0
    undecodable: int = 0
    nodes: int = 0
    pods: int = 0
    assignments: int = 0
    preemptions: int = 0
    releases: int = 0
    violations: list[Violation] = []

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
            verifier.projection.skip(entry.seq, None)
            continue
        verifier.check(entry)
        verifier.projection.apply(entry.seq, entry.envelope, index=entry.index, last=entry.last)
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
        for finding in check_liveness_and_optimality(decision_entries(stored_events(entries)))
    )
    report.violations.sort(key=lambda violation: violation.seq)
    return report


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


# --------------------------------------------------------------------------- gpupool explain


class GpuRoom(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    used: Share
    free: Share
    fits: bool
    note: str = ""


class Explanation(msgspec.Struct, frozen=True, kw_only=True):
    pod: PodRef
    node: str
    at: datetime
    origin: datetime
    status: str
    """One sentence: where the pod is (waiting at position n, running on GPU g, ...)."""
    waiting: bool = False
    ahead: list[QueuedPod] = []
    needs: Share | None = None
    gpus: list[GpuRoom] = []
    blockers: list[str] = []
    estimate: str = ""


def explain(entries: Sequence[Entry], pod_ref: PodRef, at: datetime | None = None) -> Explanation:
    """Why the pod waits (or that it does not), as of ``at`` (default: the log's last entry)."""
    origin = log_origin(entries)
    if origin is None:
        raise AuditError("the log has no readable entries")
    folded = fold_until(entries, at)
    now = at if at is not None else (folded.last.envelope.time if folded.last else origin)
    state = folded.state
    pod = state.pods.get(pod_ref)
    if pod is None:
        history = pod_history(entries, pod_ref)  # raises AuditError if the pod never appears
        last = [line for line in history.lines if line.time <= now]
        said = last[-1].text if last else "not registered yet"
        return Explanation(
            pod=pod_ref,
            node=history.node,
            at=now,
            origin=origin,
            status=f"{pod_ref} is not registered at this time (its last step: {said})",
        )
    if pod.phase == "running":
        since = f" since {format_offset(pod.running_since, origin)}" if pod.running_since else ""
        evicting = (
            f"; it is being preempted for {pod.evicted_by} ({pod.evict_reason})"
            if pod.evicted_by is not None
            else ""
        )
        return Explanation(
            pod=pod_ref,
            node=pod.node,
            at=now,
            origin=origin,
            status=f"{pod_ref} is not waiting: it runs on GPU {pod.gpu_index} of {pod.node}{since}{evicting}",
        )
    if pod.phase == "dormant":
        return Explanation(
            pod=pod_ref,
            node=pod.node,
            at=now,
            origin=origin,
            status=f"{pod_ref} is not waiting: it is dormant on {pod.node} (it has not asked for a GPU)",
        )
    return _explain_waiting(state, pod, now, origin, folded.holds)


def _explain_waiting(
    state: State, pod: PodState, now: datetime, origin: datetime, holds: list[Hold]
) -> Explanation:
    node = state.nodes[pod.node]
    pods = state.pods_on(pod.node)
    queue = ready_queue(state, pod.node)
    position = next(i for i, queued in enumerate(queue, start=1) if queued.ref == pod.ref)
    head = queue[0]
    usage = gpu_usage(node, pods)
    reserved = (
        reservation_gpu(usage, head, pods) if node.qos.backfill and head.ref != pod.ref else None
    )
    evicting = {p.gpu_index: p for p in pods if p.evicted_by is not None}
    rooms: list[GpuRoom] = []
    for index in sorted(usage):
        used = usage[index]
        notes = []
        if index == reserved:
            notes.append(f"reserved for the head, {head.ref}")
        if index in evicting:
            victim = evicting[index]
            notes.append(f"{victim.ref} is being preempted there for {victim.evicted_by}")
        rooms.append(
            GpuRoom(
                index=index,
                used=used,
                free=Share(core=GPU_PERCENT - used.core, memory=GPU_PERCENT - used.memory),
                fits=fits(used, pod.limits),
                note="; ".join(notes),
            )
        )
    ready_since = pod.ready_since or now
    status = (
        f"{pod.ref} waits on {pod.node}: position {position} of {len(queue)}, ready since "
        f"{format_offset(ready_since, origin)} ({format_duration(now - ready_since)} so far)"
    )
    ahead = [
        QueuedPod(
            position=i,
            pod=queued.ref,
            priority=queued.priority,
            limits=queued.limits,
            ready_since=queued.ready_since,
        )
        for i, queued in enumerate(queue[: position - 1], start=1)
    ]
    return Explanation(
        pod=pod.ref,
        node=pod.node,
        at=now,
        origin=origin,
        status=status,
        waiting=True,
        ahead=ahead,
        needs=pod.limits,
        gpus=rooms,
        blockers=_blockers(state, node, pod, head, usage, rooms, reserved, now, origin),
        estimate=_estimate(node, position, holds),
    )


def _blockers(
    state: State,
    node: NodeState,
    pod: PodState,
    head: PodState,
    usage: GpuUsage,
    rooms: list[GpuRoom],
    reserved: int | None,
    now: datetime,
    origin: datetime,
) -> list[str]:
    if node.policy != "share-pool":
        return [f"node {node.name} does not run share-pool (policy {node.policy or 'none'})"]
    room = [r.index for r in rooms if r.fits]
    needs = share_text(pod.limits)
    if head.ref != pod.ref:
        said = [
            f"head-of-line: the queue is served in order and the head, {head.ref}, "
            f"fits on no GPU yet"
        ]
        if node.qos.backfill:
            elsewhere = [index for index in room if index != reserved]
            if elsewhere:
                said.append(
                    f"backfill is on and it fits GPU {elsewhere[0]}: it starts at the next "
                    "scheduling pass"
                )
            else:
                said.append(
                    f"backfill is on, but no GPU other than GPU {reserved} (reserved for the "
                    f"head) has {needs} free"
                )
        elif room:
            said.append(f"it would fit GPU {room[0]} now, but backfill is off on {node.name}")
        else:
            said.append(f"no GPU has {needs} free for it either")
        return said
    if room:
        return [f"nothing: it fits GPU {room[0]} and is assigned at the next scheduling pass"]
    said = [f"no GPU has room: it needs {needs} free on one GPU"]
    evicting = [p for p in state.pods_on(node.name) if p.evicted_by is not None]
    if evicting:
        victims = ", ".join(f"{p.ref} on GPU {p.gpu_index}" for p in evicting)
        whom = {str(p.evicted_by) for p in evicting}
        said.append(
            f"preemption under way: {victims} being preempted for {', '.join(sorted(whom))}"
        )
        return said
    if not node.qos.preempt_enabled:
        said.append(f"preemption is disabled on {node.name} (preemptEnabled is false)")
        return said
    plan = plan_preemption(state, node.name, usage, now)
    if plan is not None:
        victims = ", ".join(f"{v.pod.ref} ({v.reason})" for v in plan.victims)
        said.append(
            f"a preemption is due: {victims} on GPU {plan.gpu_index}; the preemption service "
            "plans it at its next pass"
        )
        return said
    minutes = node.qos.pod_max_duration_minutes
    running = ", ".join(
        f"{p.ref} (priority {p.priority})"
        for p in sorted(state.pods_on(node.name), key=lambda p: p.ref)
        if p.phase == "running" and p.policy == "share-pool"
    )
    reason = f"no eligible victim: none of {running} has a priority below {pod.priority}"
    if minutes is None:
        said.append(f"{reason}, and podMaxDurationMinutes is not set")
        return said
    said.append(f"{reason}, and none has held its GPU for podMaxDurationMinutes ({minutes} min)")
    check = next_preemption_check(state, node.name, now)
    if check is not None:
        limit = timedelta(minutes=minutes)
        reaching = sorted(
            str(p.ref)
            for p in state.pods_on(node.name)
            if p.phase == "running"
            and p.running_since is not None
            and p.running_since + limit == check
        )
        said.append(
            f"{', '.join(reaching)} reaches podMaxDurationMinutes at "
            f"{format_offset(check, origin)}; preemption is considered again then"
        )
    return said


def _estimate(node: NodeState, position: int, holds: list[Hold]) -> str:
    completed = [hold for hold in holds if hold.node == node.name and hold.reason == "completed"]
    recent = completed[-RECENT_HOLDS:]
    gpus = len(node.gpus) or node.gpu_count
    if not recent or not gpus:
        return f"no estimate: no assignment on {node.name} has completed yet"
    median = timedelta(seconds=statistics.median(h.held.total_seconds() for h in recent))
    wait = median * position / gpus
    ahead = position - 1
    plural = "s" if len(recent) > 1 else ""
    return (
        f"about {format_duration(wait)} more = median hold {format_duration(median)} "
        f"(the {len(recent)} most recent completed assignment{plural} on {node.name}) "
        f"× {position} (pods ahead {ahead} + itself) / {gpus} GPUs; an estimate from recent "
        "history, not a promise"
    )
