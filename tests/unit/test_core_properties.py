"""Properties of the core over random command sequences, driven like the simulator drives it.

Random nodes (1-2, of 1-4 GPUs, share-pool or static, random QoS with preemption
and backfill) and pods (random requests, limits, priorities); random register,
ready, complete, fail, out-of-memory, cancel, delete, victim releases and time
advances. After each command the driver sends Schedule and PlanPreemption to the
node, as admission-queue and preemption do, until nothing more happens; victims
release at once or when a later step says so. The invariants are checked after
every step, and per event as it is logged.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from core_gwt import T0, gpus, manifest, ref
from hypothesis import HealthCheck, given, settings
from hypothesis import event as note_event
from hypothesis import strategies as st

from gpupool.core import (
    Command,
    ConfigureNode,
    PlanPreemption,
    RegisterPod,
    RemovePod,
    ReportInventory,
    ReportRelease,
    RequestGpu,
    Schedule,
    State,
    choose_gpu,
    decide,
    evolve,
    fold,
    gpu_usage,
    pods_touched,
    queue_positions,
    ready_queue,
)
from gpupool.core.evolve import reindex
from gpupool.core.placement import reservation_gpu, static_usage
from gpupool.core.validation import CORE_RESOURCE, MEMORY_RESOURCE
from gpupool.events import (
    Assigned,
    Envelope,
    Event,
    PodReady,
    PodRef,
    PodRegistered,
    PodRemoved,
    Preempted,
    Released,
    ReleaseReason,
    Share,
)


@dataclass(frozen=True)
class NodeSpec:
    name: str
    gpu_count: int
    policy: str
    qos: str


@dataclass(frozen=True)
class PodSpec:
    name: str
    node: int
    request: tuple[int, int]
    limit: tuple[int, int]
    priority: int
    policy_matches: bool


@dataclass(frozen=True)
class Step:
    kind: str
    target: int = 0
    minutes: int = 0


@dataclass(frozen=True)
class Case:
    nodes: list[NodeSpec]
    pods: list[PodSpec]
    steps: list[Step]
    release_at_once: bool


@st.composite
def qos_annotations(draw: st.DrawFn) -> str:
    parts = [f'"preemptEnabled": {"true" if draw(st.integers(0, 3)) > 0 else "false"}']
    minutes = draw(st.sampled_from([None, 1, 2, 5, 10]))
    if minutes is not None:
        parts.append(f'"podMaxDurationMinutes": {minutes}')
    if draw(st.booleans()):
        parts.append('"backfill": true')
    return "{" + ", ".join(parts) + "}"


PERCENTS = [1, 5, 10, 20, 25, 30, 40, 50, 60, 75, 100]


@st.composite
def shares(draw: st.DrawFn) -> tuple[tuple[int, int], tuple[int, int]]:
    core = draw(st.sampled_from(PERCENTS[:8]))
    memory = draw(st.sampled_from(PERCENTS[:8]))
    # Limits above requests make pods contend for GPUs (what the queue and preemption are for).
    limit_core = max(core, draw(st.sampled_from([100, 100, 75, 50, 30, 1])))
    limit_memory = max(memory, draw(st.sampled_from([100, 60, 50, 40, 1])))
    return (core, memory), (limit_core, limit_memory)


STEP_KINDS = [
    *["ready"] * 5,
    *["complete"] * 2,
    "fail",
    "oom",
    "cancel",
    "delete",
    "register",
    *["advance"] * 2,
    "release-victims",
    "inventory",
]
"""``inventory``: the node's executor reports ``minutes % 4 + 1`` GPUs (shrinks or grows it)."""


@st.composite
def cases(draw: st.DrawFn) -> Case:
    nodes = [
        NodeSpec(
            name=f"node-{i}",
            gpu_count=draw(st.integers(1, 4)),
            policy=draw(st.sampled_from(["share-pool", "share-pool", "share-pool", "static"])),
            qos=draw(qos_annotations()),
        )
        for i in range(draw(st.integers(1, 2)))
    ]
    pods = []
    for i in range(draw(st.integers(1, 8))):
        request, limit = draw(shares())
        pods.append(
            PodSpec(
                name=f"pod-{i}",
                node=draw(st.integers(0, len(nodes) - 1)),
                request=request,
                limit=limit,
                priority=draw(st.integers(0, 2)),
                policy_matches=draw(st.integers(0, 9)) > 0,
            )
        )
    step = st.builds(
        Step,
        kind=st.sampled_from(STEP_KINDS),
        target=st.integers(0, len(pods) - 1),
        minutes=st.sampled_from([0, 1, 5, 15]),
    )
    steps = draw(st.lists(step, min_size=5, max_size=40))
    # Register every pod up front and let it ask for a GPU once, so that every case
    # starts with contention; the random steps follow.
    opening = [
        Step(kind=kind, target=i) for kind in ("register", "ready") for i in range(len(pods))
    ]
    return Case(nodes=nodes, pods=pods, steps=opening + steps, release_at_once=draw(st.booleans()))


@dataclass
class Driver:
    """Plays the services' parts: sends each command a service would, folds every event."""

    case: Case
    state: State = field(default_factory=State)
    log: list[Envelope] = field(default_factory=list)
    now: datetime = T0
    holding: dict[PodRef, bool] = field(default_factory=dict)
    priorities: dict[PodRef, int] = field(default_factory=dict)
    overtaken: int = 0
    became_ready: dict[PodRef, int] = field(default_factory=dict)
    """Where in the log each pod last became ready: the FIFO order within a priority."""
    shrunk: set[str] = field(default_factory=set)
    processes: dict[PodRef, tuple[str, int, Share, bool]] = field(default_factory=dict)
    """The executor's view: pods whose processes run, on (node, GPU, share, static).
    A process starts at Assigned and ends just before the executor reports its release."""

    def run(self, command: Command) -> list[Event]:
        events = decide(self.state, command, self.now)
        for event in events:
            self.check_event(command, event)
            envelope = Envelope(id=f"e-{len(self.log)}", time=self.now, event=event)
            evolve(self.state, envelope)
            self.log.append(envelope)
        return events

    def settle(self, node: str) -> None:
        for _ in range(1000):
            assigned = self.run(Schedule(node=node))
            preempted = self.run(PlanPreemption(node=node))
            released = self.release_victims(node) if self.case.release_at_once else False
            if not assigned and not preempted and not released:
                return
        raise AssertionError("the node never settled")

    def release_victims(self, node: str) -> bool:
        """The executor ends what is releasing (preempted or deleted), then records it."""
        released = False
        for pod in self.state.pods_on(node):
            if pod.evicted_by is not None:
                self.processes.pop(pod.ref, None)
                released |= bool(
                    self.run(ReportRelease(pod=pod.ref, node=node, reason="preempted"))
                )
            elif pod.removed:
                self.processes.pop(pod.ref, None)
                released |= bool(
                    self.run(ReportRelease(pod=pod.ref, node=node, reason="cancelled"))
                )
        return released

    def start(self) -> None:
        for spec in self.case.nodes:
            self.run(
                ReportInventory(
                    node=spec.name, gpus=gpus(spec.gpu_count, spec.name), source="simulated"
                )
            )
            self.run(
                ConfigureNode(
                    node=spec.name,
                    policy_label=spec.policy,
                    qos_annotation=spec.qos,
                    gpu_count=spec.gpu_count,
                )
            )

    def step(self, step: Step) -> None:
        if step.kind == "advance":
            self.now += timedelta(minutes=step.minutes)
        elif step.kind == "release-victims":
            self.release_victims(self.case.nodes[step.target % len(self.case.nodes)].name)
        elif step.kind == "inventory":
            name = self.case.nodes[step.target % len(self.case.nodes)].name
            if step.minutes % 4 + 1 < len(self.state.node(name).gpus):
                self.shrunk.add(name)
            for event in self.run(
                ReportInventory(
                    node=name, gpus=gpus(step.minutes % 4 + 1, name), source="simulated"
                )
            ):
                if isinstance(event, Released):
                    # a vanished GPU: no process can use it any more (the executor ends them)
                    self.processes.pop(event.pod, None)
        else:
            self.pod_step(step)
        for spec in self.case.nodes:
            self.settle(spec.name)

    def pod_step(self, step: Step) -> None:
        spec = self.case.pods[step.target]
        node = self.case.nodes[spec.node]
        pod = ref(spec.name)
        releases: dict[str, ReleaseReason] = {
            "complete": "completed",
            "fail": "failed",
            "oom": "out-of-memory",
            "cancel": "cancelled",
        }
        if step.kind == "register":
            policy = (
                node.policy
                if spec.policy_matches
                else {"static": "share-pool"}.get(node.policy, "static")
            )
            self.run(
                RegisterPod(
                    manifest=manifest(
                        spec.name,
                        node=node.name,
                        policy=policy,
                        priority=spec.priority,
                        requests={CORE_RESOURCE: spec.request[0], MEMORY_RESOURCE: spec.request[1]},
                        limits={CORE_RESOURCE: spec.limit[0], MEMORY_RESOURCE: spec.limit[1]},
                    )
                )
            )
        elif step.kind == "ready":
            self.run(RequestGpu(pod=pod, node=node.name))
        elif step.kind == "delete":
            self.run(RemovePod(pod=pod, node=node.name))
        else:
            self.processes.pop(pod, None)  # the process ended: then its release is reported
            self.run(ReportRelease(pod=pod, node=node.name, reason=releases[step.kind]))

    # ------------------------------------------------------------------ per event

    def check_event(self, command: Command, event: Event) -> None:
        match event:
            case PodRegistered():
                self.priorities[event.pod] = event.priority
            case PodReady():
                self.became_ready[event.pod] = len(self.log)
            case Assigned():
                assert not self.holding.get(event.pod), (
                    f"{event.pod} assigned twice without a release"
                )
                self.holding[event.pod] = True
                assigned = self.state.pods[event.pod]
                static = assigned.policy == "static"
                self.processes[event.pod] = (
                    event.node,
                    event.gpu_index,
                    assigned.requests if static else assigned.limits,
                    static,
                )
                if isinstance(command, Schedule):
                    self.check_queue_order(event)
            case Released(reason="gpu-vanished"):
                pod = self.state.pods[event.pod]
                assert event.gpu_index == pod.gpu_index
                assert self.holding.get(event.pod) or pod.policy == "static", (
                    f"{event.pod} released a vanished GPU it did not hold"
                )
                self.holding[event.pod] = False
            case Released():
                if event.gpu_index is None:
                    assert not self.holding.get(event.pod)
                else:
                    assert self.holding.get(event.pod), (
                        f"{event.pod} released a GPU it did not hold"
                    )
                    assert event.gpu_index == self.state.pods[event.pod].gpu_index
                self.holding[event.pod] = False
            case PodRemoved():
                pass  # a pod holding a slot keeps it, releasing, until its Released
            case Preempted():
                victim = self.state.pods[event.victim]
                assert self.priorities[event.victim] <= self.priorities[event.preemptor]
                assert victim.phase == "running" and victim.gpu_index == event.gpu_index
                assert victim.policy == "share-pool"
                qos = self.state.nodes[event.node].qos
                assert qos.preempt_enabled
                if event.reason == "priority":
                    assert self.priorities[event.victim] < self.priorities[event.preemptor]
                else:
                    assert qos.pod_max_duration_minutes is not None
                    assert victim.running_since is not None
                    assert self.now - victim.running_since >= timedelta(
                        minutes=qos.pod_max_duration_minutes
                    )
                head = ready_queue(self.state, event.node)[0]
                assert head.ref == event.preemptor
            case _:
                pass

    def check_queue_order(self, event: Assigned) -> None:
        """Strictly in order; with backfill, a pod behind the head never takes its reservation."""
        queue = ready_queue(self.state, event.node)
        node = self.state.nodes[event.node]
        if queue[0].ref == event.pod:
            return
        assert node.qos.backfill, f"{event.pod} overtook the head {queue[0].ref} without backfill"
        self.overtaken += 1
        pods = self.state.pods_on(event.node)
        usage = gpu_usage(node, pods)
        head = queue[0]
        assert choose_gpu(usage, head.limits) is None, "the head fits but a later pod was served"
        assert event.gpu_index != reservation_gpu(usage, head, pods)

    # ------------------------------------------------------------------ per step

    def check_processes(self) -> None:
        """No GPU ever shared beyond its limits while a process still runs (finding 2)."""
        used: dict[tuple[str, int, bool], list[int]] = {}
        for node, gpu, held, static in self.processes.values():
            total = used.setdefault((node, gpu, static), [0, 0])
            total[0] += held.core
            total[1] += held.memory
        for (node, gpu, _), (core, memory) in used.items():
            assert core <= 100 and memory <= 100, (
                f"GPU {gpu} of {node} shared beyond its limits by live processes: {core}/{memory}"
            )

    def check_state(self) -> None:
        self.check_processes()
        state = self.state
        assert fold(self.log) == state, "folding the log from scratch differs from the live state"
        assert reindex(copy.deepcopy(state)) == state, "evolve's node indexes differ from the pods"
        for name, node in state.nodes.items():
            pods = state.pods_on(name)
            assert [state.pods[key[4]] for key in node.queue] == ready_queue(state, name)
            assert node.usage == {
                gpu: used for gpu, used in gpu_usage(node, pods).items() if used.core or used.memory
            }
            present = {gpu.index for gpu in node.gpus}
            for pod in pods:
                if pod.gpu_index is not None:
                    assert pod.gpu_index in present, f"{pod.ref} holds a GPU not in the inventory"
            for used in gpu_usage(node, pods).values():
                assert used.core <= 100 and used.memory <= 100
            for used in static_usage(node, pods).values():
                assert used.core <= 100 and used.memory <= 100
            if name not in self.shrunk:  # pods admitted before a shrink stay registered
                requested_core = sum(p.requests.core for p in pods)
                requested_memory = sum(p.requests.memory for p in pods)
                assert requested_core <= node.allocatable_percent
                assert requested_memory <= node.allocatable_percent
            positions = queue_positions(state, name)
            assert sorted(positions.values()) == list(range(1, len(positions) + 1))
            assert set(positions) == {p.ref for p in pods if p.phase == "ready"}
            expected_order = sorted(
                positions, key=lambda p: (-self.priorities[p], self.became_ready[p])
            )
            assert sorted(positions, key=positions.__getitem__) == expected_order
            assert (
                sum(p.evicted_by is not None for p in pods) == 0
                or len({p.evicted_by for p in pods if p.evicted_by is not None}) == 1
            ), "more than one preemption in flight on a node"
            queue = ready_queue(state, name)
            if queue and node.policy == "share-pool" and node.gpus:
                usage = gpu_usage(node, pods)
                assert choose_gpu(usage, queue[0].limits) is None, "the head fits but waits"
        for pod_ref, pod in state.pods.items():
            homes = [name for name, node in state.nodes.items() if pod_ref in node.pods]
            assert homes == [pod.node]
            assert pod.phase in ("dormant", "ready", "running")
            if pod.policy == "share-pool":
                assert (pod.phase == "running") == (pod.gpu_index is not None)
            else:  # a static pod keeps its binding between runs; unbound, it waits dormant
                assert pod.gpu_index is not None or pod.phase == "dormant"
            assert not pod.removed or pod.phase == "running", "only a slot holder is releasing"
            assert (pod.phase == "running") == (pod.running_since is not None)
            assert (pod.phase == "ready") == (pod.ready_since is not None)
            assert pod.evicted_by is None or pod.phase == "running"
            assert (pod.phase == "running") == bool(self.holding.get(pod_ref))
        for node in state.nodes.values():
            assert all(pod_ref in state.pods for pod_ref in node.pods)


@settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(cases())
def test_invariants_hold_after_every_step(case: Case) -> None:
    driver = Driver(case)
    driver.start()
    driver.check_state()
    for step in case.steps:
        driver.step(step)
        driver.check_state()
    for name in sorted({type(e.event).__name__ for e in driver.log}):
        note_event(f"logged {name}")
    for reason in sorted({e.event.reason for e in driver.log if isinstance(e.event, Preempted)}):
        note_event(f"preempted for {reason}")
    if driver.overtaken:
        note_event("a later pod backfilled past the head")


@settings(
    max_examples=50, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(cases())
def test_decide_never_mutates_the_state_and_is_deterministic(case: Case) -> None:
    first, second = Driver(case), Driver(case)
    for driver in (first, second):
        driver.start()
        for step in case.steps:
            driver.step(step)
    assert first.log == second.log
    state = first.state
    snapshot = fold(first.log)
    for spec in case.nodes:
        for command in (Schedule(node=spec.name), PlanPreemption(node=spec.name)):
            assert decide(state, command, first.now + timedelta(days=1)) is not None
    assert state == snapshot


@settings(
    max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(cases())
def test_folding_an_event_changes_only_the_pods_it_names(case: Case) -> None:
    """``pods_touched``: what a node-executor wakes a pod's session for. Every pod another
    than those an event names (when it names any) is the same before and after its fold."""
    driver = Driver(case)
    driver.start()
    for step in case.steps:
        driver.step(step)
    state = State()
    named_kinds: set[str] = set()
    for envelope in driver.log:
        before = {ref: copy.copy(pod) for ref, pod in state.pods.items()}
        evolve(state, envelope)
        named = pods_touched(envelope.event)
        if named is None:
            continue
        named_kinds.add(type(envelope.event).__name__)
        changed = {
            ref
            for ref in before.keys() | state.pods.keys()
            if before.get(ref) != state.pods.get(ref)
        }
        assert changed <= set(named), (envelope, changed - set(named))
    assert state == fold(driver.log)
    for name in sorted(named_kinds):
        note_event(f"checked {name}")
