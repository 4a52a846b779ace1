"""For random node states, every reason ``gpupool explain`` prints is true of the state.

The states are built directly (random GPUs, QoS, running pods that fit by limits,
some being preempted, a random ready queue, a random clock). For each waiting pod
the explanation's reasons come from the core's diagnosis; each is checked here
against the raw state by arithmetic written out in this file (sums of limits,
priorities, hold times), not by calling the core's placement or preemption
functions, and its rendered text names the GPU and the pod it is about.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from gpupool.audit import Reason, reasons
from gpupool.cli.commands.explain import reason_text
from gpupool.core.diagnosis import diagnose
from gpupool.core.evolve import reindex
from gpupool.core.state import NodeState, PodState, State
from gpupool.events import GpuInfo, PodRef, QosConfig, Share

T0 = datetime(2025, 1, 1, tzinfo=UTC)
NODE = "node-1"
LIMITS = st.sampled_from([10, 25, 30, 50, 60, 75, 100])


@st.composite
def states(draw: st.DrawFn) -> tuple[State, datetime]:
    gpu_count = draw(st.integers(1, 3))
    minutes = draw(st.one_of(st.none(), st.integers(1, 30)))
    qos = QosConfig(
        preempt_enabled=draw(st.booleans()),
        pod_max_duration_minutes=minutes,
        backfill=draw(st.booleans()),
    )
    node = NodeState(
        name=NODE,
        policy="share-pool",
        qos=qos,
        gpu_count=gpu_count,
        gpus=tuple(GpuInfo(index=i, uuid=f"GPU-{i}", memory_mib=1024) for i in range(gpu_count)),
    )
    state = State(nodes={NODE: node})
    now = T0 + timedelta(minutes=draw(st.integers(0, 60)))
    used = {i: [0, 0] for i in range(gpu_count)}
    number = 0

    def add(pod: PodState) -> None:
        state.pods[pod.ref] = pod
        node.pods[pod.ref] = None

    for _ in range(draw(st.integers(0, 5))):
        gpu = draw(st.integers(0, gpu_count - 1))
        core, memory = draw(LIMITS), draw(LIMITS)
        if used[gpu][0] + core > 100 or used[gpu][1] + memory > 100:
            continue
        used[gpu][0] += core
        used[gpu][1] += memory
        number += 1
        add(
            PodState(
                ref=PodRef(namespace="default", name=f"run-{number}"),
                node=NODE,
                policy="share-pool",
                requests=Share(core=core // 2, memory=memory // 2),
                limits=Share(core=core, memory=memory),
                priority=draw(st.sampled_from([0, 0, 5, 10])),
                uid=f"u{number}",
                registered_at=T0,
                phase="running",
                gpu_index=gpu,
                gpu_uuid=f"GPU-{gpu}",
                running_since=now - timedelta(minutes=draw(st.integers(0, 60))),
            )
        )
    for order in range(1, draw(st.integers(1, 4)) + 1):
        number += 1
        add(
            PodState(
                ref=PodRef(namespace="default", name=f"wait-{number}"),
                node=NODE,
                policy="share-pool",
                requests=Share(core=10, memory=10),
                limits=Share(core=draw(LIMITS), memory=draw(LIMITS)),
                priority=draw(st.sampled_from([0, 0, 5, 10])),
                uid=f"u{number}",
                registered_at=T0,
                phase="ready",
                ready_since=now - timedelta(seconds=order),
                ready_order=order,
            )
        )
    running = [p for p in state.pods.values() if p.phase == "running"]
    waiting = [p for p in state.pods.values() if p.phase == "ready"]
    if running and draw(st.booleans()):
        victim = draw(st.sampled_from(running))
        victim.evicted_by = draw(st.sampled_from(waiting)).ref
        victim.evict_reason = "priority"
    node.ready_counter = len(waiting)
    return reindex(state), now  # built by hand, not by evolve: compute its node indexes


# ------------------------------------------------------------------ the facts, from the raw state


def used_on(state: State, gpu: int) -> tuple[int, int]:
    pods = [
        p
        for p in state.pods.values()
        if p.phase == "running" and p.gpu_index == gpu and p.policy == "share-pool"
    ]
    return sum(p.limits.core for p in pods), sum(p.limits.memory for p in pods)


def room_for(state: State, gpu: int, want: Share) -> bool:
    core, memory = used_on(state, gpu)
    return core + want.core <= 100 and memory + want.memory <= 100


def head_of(state: State) -> PodState:
    waiting = [p for p in state.pods.values() if p.phase == "ready"]
    return min(waiting, key=lambda p: (-p.priority, p.ready_order))


def holds(reason: Reason, state: State, pod: PodState, now: datetime) -> bool:
    node = state.nodes[NODE]
    head = head_of(state)
    gpus = [g.index for g in node.gpus]
    other = state.pods.get(reason.pod) if reason.pod is not None else None
    minutes = node.qos.pod_max_duration_minutes
    match reason.kind:
        case "gpu-fits":
            return room_for(state, reason.gpu_index or 0, pod.limits)
        case "gpu-too-full":
            core, memory = used_on(state, reason.gpu_index or 0)
            short = {
                r
                for r, total in (
                    ("core", core + pod.limits.core),
                    ("memory", memory + pod.limits.memory),
                )
                if total > 100
            }
            assert reason.used == Share(core=core, memory=memory)
            return bool(short) and short == set(reason.short)
        case "reserved-for-head":
            return node.qos.backfill and reason.pod == head.ref != pod.ref
        case "assigned-next-pass":
            return room_for(state, reason.gpu_index or 0, pod.limits)
        case "queue-moving":
            # usage only grows within a pass: whatever it assigns fits the state as it is
            return bool(reason.victims) and all(
                state.pods[m].phase == "ready"
                and any(room_for(state, g, state.pods[m].limits) for g in gpus)
                for m in reason.victims
            )
        case "head-of-line":
            return reason.pod == head.ref != pod.ref
        case "backfill-off":
            return not node.qos.backfill and room_for(state, reason.gpu_index or 0, pod.limits)
        case "backfill-reserved-only":
            fitting = [g for g in gpus if room_for(state, g, pod.limits)]
            return node.qos.backfill and fitting == [reason.gpu_index]
        case "backfill-no-room":
            return node.qos.backfill and not any(room_for(state, g, pod.limits) for g in gpus)
        case "head-fits-nowhere":
            return reason.pod == head.ref and not any(room_for(state, g, head.limits) for g in gpus)
        case "preemption-under-way":
            return (
                other is not None
                and other.evicted_by == reason.preemptor
                and other.gpu_index == reason.gpu_index
            )
        case "preemption-disabled":
            return not node.qos.preempt_enabled
        case "victim-eligible":
            if other is None or other.phase != "running" or other.evicted_by is not None:
                return False
            assert other.running_since is not None
            if reason.why == "priority":
                return other.priority < head.priority
            return (
                reason.why == "max-duration"
                and minutes is not None
                and other.priority <= head.priority
                and now - other.running_since >= timedelta(minutes=minutes)
            )
        case "victim-protected":
            if other is None:
                return False
            match reason.why:
                case "static":
                    return other.policy == "static"
                case "being-preempted":
                    return other.evicted_by is not None
                case "higher-priority":
                    return other.priority > head.priority
                case "same-priority-no-max-duration":
                    return other.priority == head.priority and minutes is None
                case "same-priority-held-too-briefly":
                    assert other.running_since is not None and minutes is not None
                    return (
                        other.priority == head.priority
                        and now - other.running_since < timedelta(minutes=minutes)
                    )
            return False
        case "victims-free-too-little" | "preemption-due":
            core, memory = used_on(state, reason.gpu_index or 0)
            for victim in reason.victims:
                core -= state.pods[victim].limits.core
                memory -= state.pods[victim].limits.memory
            enough = core + head.limits.core <= 100 and memory + head.limits.memory <= 100
            return enough == (reason.kind == "preemption-due")
        case "next-check":
            assert minutes is not None and reason.at is not None
            crossings = [
                p.running_since + timedelta(minutes=minutes)
                for p in state.pods.values()
                if p.phase == "running" and p.running_since is not None
            ]
            later = [t for t in crossings if t > now]
            reaching = all(
                (held := state.pods[v].running_since) is not None
                and held + timedelta(minutes=minutes) == reason.at
                for v in reason.victims
            )
            return bool(later) and min(later) == reason.at and bool(reason.victims) and reaching
    return False


@settings(max_examples=300, deadline=None, derandomize=True)
@given(states())
def test_every_reason_explain_prints_is_true_of_the_state(drawn: tuple[State, datetime]) -> None:
    state, now = drawn
    for pod in [p for p in state.pods.values() if p.phase == "ready"]:
        diagnosis = diagnose(state, pod.ref, now)
        said = reasons(diagnosis)
        assert said, diagnosis
        for reason in said:
            assert holds(reason, state, pod, now), (reason, diagnosis)
            text = reason_text(reason, T0)
            if reason.gpu_index is not None:
                assert f"GPU {reason.gpu_index}" in text
            if reason.pod is not None:
                assert str(reason.pod) in text


def test_the_reported_bug_a_lower_priority_pod_is_named_eligible() -> None:
    """A waiting priority-5 head and a running priority-0 pod: explain says it may be preempted."""
    node = NodeState(
        name=NODE,
        policy="share-pool",
        qos=QosConfig(preempt_enabled=True),
        gpu_count=1,
        gpus=(GpuInfo(index=0, uuid="GPU-0", memory_mib=1024),),
    )
    low = PodState(
        ref=PodRef(namespace="default", name="low"),
        node=NODE,
        policy="share-pool",
        requests=Share(core=50, memory=50),
        limits=Share(core=100, memory=100),
        priority=0,
        uid="1",
        registered_at=T0,
        phase="running",
        gpu_index=0,
        gpu_uuid="GPU-0",
        running_since=T0,
    )
    high = PodState(
        ref=PodRef(namespace="default", name="high"),
        node=NODE,
        policy="share-pool",
        requests=Share(core=50, memory=50),
        limits=Share(core=100, memory=100),
        priority=5,
        uid="2",
        registered_at=T0,
        phase="ready",
        ready_since=T0,
        ready_order=1,
    )
    node.pods = {low.ref: None, high.ref: None}
    state = reindex(State(nodes={NODE: node}, pods={low.ref: low, high.ref: high}))
    said = reasons(diagnose(state, high.ref, T0 + timedelta(minutes=1)))
    texts = [reason_text(r, T0) for r in said]
    assert "default/low on GPU 0 may be preempted (priority 0 below the head's 5)" in texts
    assert [r.kind for r in said][-1] == "preemption-due"
