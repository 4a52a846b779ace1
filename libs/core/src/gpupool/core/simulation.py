"""Run a scenario through the same decide/evolve core with a simulated clock.

The simulator stands in for the services: it sends each command the real
service would send, folds every event, and plays the node-executor's part (a
Preempted victim releases at once; a pod with ``runs_for`` completes that many
seconds after it is assigned). Output is the event log, deterministic byte for
byte: ids come from a counter and times from the simulated clock.
"""

from __future__ import annotations

import gc
import heapq
from datetime import UTC, datetime, timedelta
from typing import Literal

import msgspec

from gpupool.core.decide import (
    Command,
    ConfigureNode,
    RegisterPod,
    RemovePod,
    ReportInventory,
    ReportRelease,
    RequestGpu,
    decide,
    plan_node_preemption,
    schedule,
)
from gpupool.core.evolve import evolve
from gpupool.core.preemption import next_preemption_check
from gpupool.core.state import State
from gpupool.core.validation import (
    COMPUTE_CLASS_LABEL,
    CORE_RESOURCE,
    MEMORY_RESOURCE,
    POLICY_LABEL,
    ContainerResources,
    PodManifest,
)
from gpupool.events import (
    Assigned,
    Envelope,
    Event,
    GpuInfo,
    PodRef,
    Preempted,
    Released,
    ReleaseReason,
    event_node,
)
from gpupool.events.limits import GpuCount, MemoryMiB

DEFAULT_START = datetime(2025, 1, 1, tzinfo=UTC)
ActionKind = Literal["ready", "complete", "fail", "oom", "cancel", "delete", "set-policy"]


class ScenarioNode(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str
    gpus: GpuCount
    gpu_memory_mib: MemoryMiB = 81920
    policy: str = "share-pool"
    qos: str | None = None
    """The ``alibabacloud.com/gpu-share-qos-config`` annotation, as JSON text."""
    exclusive_gpu_pods: list[str] = []


class ScenarioShare(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    core: int | str | None = None
    memory: int | str | None = None


class ScenarioPod(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str
    node: str
    namespace: str = "default"
    requests: ScenarioShare = ScenarioShare()
    limits: ScenarioShare | None = None
    priority: int = 0
    policy: str = "share-pool"
    compute_class: str = "gpu-hpn"
    requeue: bool = False
    """After being preempted, become ready again at once (``gpupool run --requeue``)."""
    owner_uid: int | None = None
    """Local mode: the user who may run it (else the cluster file's owner); not simulated."""


class ScenarioAction(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    at: float
    """Seconds since the scenario start."""
    action: ActionKind
    pod: str | None = None
    namespace: str = "default"
    node: str | None = None
    policy: str | None = None
    qos: str | None = None
    runs_for: float | None = None
    """With ``ready``: the task completes this many seconds after the pod is assigned."""
    exit_code: int | None = None


class Scenario(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    nodes: list[ScenarioNode]
    pods: list[ScenarioPod] = []
    timeline: list[ScenarioAction] = []
    start: datetime = DEFAULT_START
    description: str = ""
    max_events: int = 1_000_000
    """A scenario that has not settled after this many events is an error, not a hang (e.g.
    tasks longer than podMaxDurationMinutes, re-queued after every preemption, never finish)."""


class ScenarioError(ValueError):
    """The scenario refers to something it does not define (the message names it)."""


class _PreemptionCheck(msgspec.Struct, frozen=True):
    node: str


class _Completion(msgspec.Struct, frozen=True):
    """A ``runs_for`` task ending; ``token`` ties it to the assignment that started it."""

    pod: PodRef
    node: str
    token: int


_Timer = ScenarioAction | _PreemptionCheck | _Completion


def pod_manifest(pod: ScenarioPod) -> PodManifest:
    return PodManifest(
        namespace=pod.namespace,
        name=pod.name,
        node=pod.node,
        uid=f"uid-{pod.namespace}-{pod.name}",
        labels={COMPUTE_CLASS_LABEL: pod.compute_class, POLICY_LABEL: pod.policy},
        priority=pod.priority,
        containers=(
            ContainerResources(
                name="main", requests=_share_table(pod.requests), limits=_share_table(pod.limits)
            ),
        ),
    )


def _share_table(share: ScenarioShare | None) -> dict[str, str | int]:
    """A container's requests or limits as a manifest writes them (only what is set)."""
    table: dict[str, str | int] = {}
    if share is not None:
        if share.core is not None:
            table[CORE_RESOURCE] = share.core
        if share.memory is not None:
            table[MEMORY_RESOURCE] = share.memory
    return table


class Simulator:
    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.state = State()
        self.log: list[Envelope] = []
        self._timers: list[tuple[datetime, int, _Timer]] = []
        """The timers set while running (completions, preemption checks): a heap."""
        self._timeline: list[tuple[datetime, int, ScenarioAction, PodRef | None]] = []
        """The scenario's own actions, sorted: merged with the heap by the same key (time,
        then the order they were set in), so the heap holds only what is pending."""
        self._timer_seq = 0
        self._runs_for: dict[PodRef, float] = {}
        self._durations: dict[float, timedelta] = {}
        self._checks_due: set[tuple[str, datetime]] = set()
        """Preemption checks already on the timer (one per node and moment)."""
        self._completion_due: dict[PodRef, int] = {}
        self._requeue = {
            PodRef(namespace=p.namespace, name=p.name) for p in scenario.pods if p.requeue
        }
        self._correlation = "setup"
        self._pod_nodes: dict[PodRef, str] = {}
        """Each scenario pod's node (the first pod of a name, as the scenario lists them)."""
        for pod in scenario.pods:
            self._pod_nodes.setdefault(PodRef(namespace=pod.namespace, name=pod.name), pod.node)

    # -- the log
    def _emit(self, events: list[Event], now: datetime) -> list[Event]:
        if not events:
            return events  # most decisions decide nothing
        if len(self.log) + len(events) > self.scenario.max_events:
            raise ScenarioError(
                f"the scenario has not settled after {self.scenario.max_events} events "
                f"(simulated time {now.isoformat()}); raise max_events if that is expected"
            )
        log, state, correlation = self.log, self.state, self._correlation
        append = log.append
        count = len(log)
        cause = log[-1].id if log else ""
        for event in events:
            count += 1
            envelope = Envelope(
                id="sim-%08d" % count,  # noqa: UP031 (faster than the f-string's format)
                time=now,
                event=event,
                correlation_id=correlation,
                causation_id=cause,
            )
            evolve(state, envelope)
            append(envelope)
            cause = envelope.id
        return events

    def _run(self, command: Command, now: datetime) -> list[Event]:
        return self._emit(decide(self.state, command, now), now)

    def _duration(self, seconds: float) -> timedelta:
        """``timedelta(seconds=seconds)``, made once per value (the tasks' times repeat)."""
        found = self._durations.get(seconds)
        if found is None:
            found = self._durations[seconds] = timedelta(seconds=seconds)
        return found

    def _timer(self, at: datetime, timer: _Timer) -> None:
        self._timer_seq += 1
        heapq.heappush(self._timers, (at, self._timer_seq, timer))

    # -- the services' reactions to a node's events
    def _settle(self, node: str, now: datetime) -> None:
        # decide(state, Schedule(node=node)) and decide(state, PlanPreemption(node=node)),
        # without the command and its dispatch
        state, runs_for = self.state, self._runs_for
        while True:
            assigned = schedule(state, node, now)
            if assigned:
                self._emit(assigned, now)
                for event in assigned:
                    if type(event) is Assigned and event.pod in runs_for:
                        self._completion_due[event.pod] = len(self.log)
                        self._timer(
                            now + self._duration(runs_for[event.pod]),
                            _Completion(pod=event.pod, node=node, token=len(self.log)),
                        )
            preempted = plan_node_preemption(state, node, now)
            if not preempted:
                # Nothing more to decide: the Schedule served the queue until its head was
                # blocked on the state its own Assigned make (folded above: a Schedule now would
                # decide nothing), and PlanPreemption saw that very state.
                break
            self._emit(preempted, now)
            for event in preempted:
                if isinstance(event, Preempted):
                    # the victim's run is over: its completion timer goes with it
                    self._completion_due.pop(event.victim, None)
                    released = self._run(
                        ReportRelease(pod=event.victim, node=node, reason="preempted"), now
                    )
                    if event.victim in self._requeue and any(
                        isinstance(r, Released) for r in released
                    ):
                        self._run(RequestGpu(pod=event.victim, node=node), now)
        check = next_preemption_check(state, node, now)
        if check is not None and (node, check) not in self._checks_due:
            self._checks_due.add((node, check))
            self._timer(check, _PreemptionCheck(node=node))

    # -- the scenario
    def run(self) -> list[Envelope]:
        """The scenario's log, from its start until no timer is left.

        The cyclic garbage collector is suspended while it runs (and restored after, as it
        was): the log and the state it folds hold no reference cycles, and a growing log of
        tens of thousands of envelopes made the collector traverse it again and again (a
        fifth of the CPU of a 70,000-event run, docs/benchmarks.md). Reference counting
        frees everything as before; a cycle made meanwhile waits for the next collection.
        """
        collecting = gc.isenabled()
        gc.disable()
        try:
            return self._run_scenario()
        finally:
            if collecting:
                gc.enable()

    def _run_scenario(self) -> list[Envelope]:
        start = self.scenario.start
        for node in self.scenario.nodes:
            gpus = tuple(
                GpuInfo(
                    index=i,
                    uuid=f"GPU-SIMULATED-{node.name}-{i}",
                    memory_mib=node.gpu_memory_mib,
                    name="simulated",
                )
                for i in range(node.gpus)
            )
            self._run(ReportInventory(node=node.name, gpus=gpus, source="simulated"), start)
            self._run(
                ConfigureNode(
                    node=node.name,
                    policy_label=node.policy,
                    qos_annotation=node.qos,
                    gpu_count=node.gpus,
                    exclusive_gpu_pods=tuple(node.exclusive_gpu_pods),
                ),
                start,
            )
        known_nodes = {node.name for node in self.scenario.nodes}
        for pod in self.scenario.pods:
            if pod.node not in known_nodes:
                raise ScenarioError(f"pod {pod.name!r}: node {pod.node!r} is not in nodes")
            self._run(RegisterPod(manifest=pod_manifest(pod)), start)
        timeline = self._timeline
        for index, action in enumerate(self.scenario.timeline):
            ref = None
            if action.pod is not None:
                ref = PodRef(namespace=action.namespace, name=action.pod)
                if ref not in self._pod_nodes:
                    raise ScenarioError(
                        f"timeline[{index}]: pod {action.namespace}/{action.pod} is not in pods"
                    )
            self._timer_seq += 1  # as _timer: the same key, sorted once below
            timeline.append((start + timedelta(seconds=action.at), self._timer_seq, action, ref))
        timeline.sort()  # (time, seq): seq is unique, so the actions never compare
        timers, pop = self._timers, heapq.heappop
        due, last = 0, len(timeline)
        index = 0
        while True:
            # the earlier of the next action and the first timer: the order one heap of both
            # would pop them in
            if timers and (
                due == last
                or (first := timers[0])[0] < (entry := timeline[due])[0]
                or (first[0] == entry[0] and first[1] < entry[1])
            ):
                now, _, timer = pop(timers)
            elif due < last:  # the scenario's own actions
                now, _, action, ref = timeline[due]
                due += 1
                index += 1
                self._correlation = f"step-{index}"
                self._act(action, now, ref)
                continue
            else:
                break
            index += 1
            self._correlation = f"step-{index}"
            # by exact type: the timers are final structs
            if type(timer) is _Completion:
                if self._completion_due.get(timer.pod) == timer.token:
                    self._release(timer.pod, timer.node, "completed", 0, now)
                    self._settle(timer.node, now)
            elif type(timer) is _PreemptionCheck:
                self._checks_due.discard((timer.node, now))
                self._settle(timer.node, now)
            elif isinstance(timer, ScenarioAction):  # an action set as a timer
                self._act(timer, now)
        return self.log

    def _act(self, action: ScenarioAction, now: datetime, ref: PodRef | None = None) -> None:
        """``ref``: the action's pod, when made already."""
        if action.action == "set-policy":
            self._set_policy(action, now)
            return
        if action.pod is None:
            raise ScenarioError(f"action {action.action!r} at {action.at}s needs a pod")
        if ref is None:
            ref = PodRef(namespace=action.namespace, name=action.pod)
        pod_node = self._pod_nodes[ref]
        events: list[Event]
        match action.action:
            case "ready":
                if action.runs_for is not None:
                    self._runs_for[ref] = action.runs_for
                events = self._run(RequestGpu(pod=ref, node=pod_node), now)
            case "complete":
                events = self._release(ref, pod_node, "completed", action.exit_code or 0, now)
            case "fail":
                events = self._release(ref, pod_node, "failed", action.exit_code or 1, now)
            case "oom":
                events = self._release(ref, pod_node, "out-of-memory", action.exit_code or 137, now)
            case "cancel":
                events = self._release(ref, pod_node, "cancelled", None, now)
            case "delete":
                events = self._run(RemovePod(pod=ref, node=pod_node), now)
                pod = self.state.pods.get(ref)
                if pod is not None and pod.removed:
                    # the simulated executor ends its processes at once, then records it
                    events += self._release(ref, pod_node, "cancelled", None, now)
            case "set-policy":
                events = []
        for event in events:
            if event.node != pod_node:  # event_node(event)
                break
        else:
            self._settle(pod_node, now)  # the common case: one node, the pod's own
            return
        nodes = {event_node(e) for e in events}
        nodes.add(pod_node)
        for node in sorted(nodes):
            self._settle(node, now)

    def _release(
        self, ref: PodRef, node: str, reason: ReleaseReason, exit_code: int | None, now: datetime
    ) -> list[Event]:
        self._completion_due.pop(ref, None)
        self._runs_for.pop(ref, None)
        return self._run(ReportRelease(pod=ref, node=node, reason=reason, exit_code=exit_code), now)

    def _set_policy(self, action: ScenarioAction, now: datetime) -> None:
        if action.node is None:
            raise ScenarioError("set-policy needs a node")
        node = next((n for n in self.scenario.nodes if n.name == action.node), None)
        if node is None:
            raise ScenarioError(f"set-policy: node {action.node!r} is not in nodes")
        self._run(
            ConfigureNode(
                node=action.node,
                policy_label=action.policy,
                qos_annotation=action.qos if action.qos is not None else node.qos,
                gpu_count=node.gpus,
                exclusive_gpu_pods=tuple(node.exclusive_gpu_pods),
            ),
            now,
        )
        self._settle(action.node, now)


def simulate(scenario: Scenario) -> list[Envelope]:
    return Simulator(scenario).run()
