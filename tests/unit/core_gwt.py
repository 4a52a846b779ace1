"""Given/when/then over events for the pure core (after eventsourcing's ``dcb/gwt.py``).

``gwt(given=[events], when=command, then=[expected events])`` folds the given
events into a fresh State, asks ``decide`` for the command's events, checks them
against ``then`` (exactly, in order) and that ``decide`` did not touch the state,
then folds the decided events and returns the state for further checks.

Also the small builders the core tests share (pods, nodes, GPUs, times).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from gpupool.core import Command, State, decide, evolve
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
    GpuInventoryReported,
    NodeConfigured,
    PodReady,
    PodRef,
    PodRegistered,
    Policy,
    QosConfig,
    Share,
)

T0 = datetime(2025, 4, 22, 8, 0, 0, tzinfo=UTC)
NODE = "cn-wulanchabu-c.cr-xxx"

Given = Event | tuple[datetime, Event]
"""A given event, at T0 unless it comes with its own time."""


def at(seconds: float = 0, *, minutes: float = 0) -> datetime:
    return T0 + timedelta(seconds=seconds, minutes=minutes)


def ref(name: str, namespace: str = "default") -> PodRef:
    return PodRef(namespace=namespace, name=name)


def share(core: int, memory: int | None = None) -> Share:
    return Share(core=core, memory=core if memory is None else memory)


def as_share(value: int | Share) -> Share:
    return value if isinstance(value, Share) else share(value)


def gpus(count: int, node: str = NODE) -> tuple[GpuInfo, ...]:
    return tuple(
        GpuInfo(index=i, uuid=gpu_uuid(i, node), memory_mib=81920, name="test")
        for i in range(count)
    )


def gpu_uuid(index: int, node: str = NODE) -> str:
    return f"GPU-{node}-{index}"


def node_events(
    gpu_count: int,
    *,
    node: str = NODE,
    policy: Policy = "share-pool",
    qos: QosConfig | None = None,
) -> list[Event]:
    """A node with its inventory reported and GPU sharing enabled."""
    return [
        GpuInventoryReported(node=node, gpus=gpus(gpu_count, node), source="simulated"),
        NodeConfigured(node=node, policy=policy, qos=qos or QosConfig(), gpu_count=gpu_count),
    ]


def registered(
    name: str,
    request: int | Share,
    limit: int | Share | None = None,
    *,
    priority: int = 0,
    node: str = NODE,
    policy: Policy = "share-pool",
) -> PodRegistered:
    requests = as_share(request)
    limits = requests if limit is None else as_share(limit)
    return PodRegistered(
        pod=ref(name),
        node=node,
        policy=policy,
        requests=requests,
        limits=limits,
        priority=priority,
        uid=f"uid-{name}",
    )


def manifest(
    name: str = "gpu-share-demo",
    *,
    node: str = NODE,
    requests: dict[str, str | int] | None = None,
    limits: dict[str, str | int] | None = None,
    labels: dict[str, str] | None = None,
    policy: str = "share-pool",
    priority: int = 0,
    containers: tuple[ContainerResources, ...] | None = None,
    uid: str | None = None,
) -> PodManifest:
    """A pod manifest; by default one container asking 10/10 with limits 100/100."""
    if containers is None:
        containers = (
            ContainerResources(
                name="main",
                requests={CORE_RESOURCE: 10, MEMORY_RESOURCE: 10} if requests is None else requests,
                limits={CORE_RESOURCE: 100, MEMORY_RESOURCE: 100} if limits is None else limits,
            ),
        )
    return PodManifest(
        namespace="default",
        name=name,
        node=node,
        uid=f"uid-{name}" if uid is None else uid,
        labels={COMPUTE_CLASS_LABEL: "gpu-hpn", POLICY_LABEL: policy} if labels is None else labels,
        priority=priority,
        containers=containers,
    )


def given_state(given: Sequence[Given]) -> State:
    state = State()
    for index, item in enumerate(given):
        time, event = item if isinstance(item, tuple) else (T0, item)
        evolve(state, Envelope(id=f"given-{index}", time=time, event=event))
    return state


def gwt(
    given: Sequence[Given], when: Command, then: Sequence[Event], *, now: datetime = T0
) -> State:
    """Check that ``when`` decides exactly ``then`` after ``given``; return the state after both."""
    state = given_state(given)
    before = copy.deepcopy(state)
    decided = decide(state, when, now)
    assert decided == list(then)
    assert state == before, "decide mutated the state"
    for index, event in enumerate(decided):
        evolve(state, Envelope(id=f"then-{index}", time=now, event=event))
    return state


@dataclass(frozen=True)
class Run:
    """A share-pool pod running on ``gpu`` since ``since`` (for topology tables)."""

    name: str
    gpu: int
    limit: int | Share
    priority: int = 0
    since: datetime = T0


@dataclass(frozen=True)
class Wait:
    """A share-pool pod waiting in the ready queue (in the order the table lists them)."""

    name: str
    limit: int | Share
    priority: int = 0


def topology(
    gpu_count: int,
    running: Sequence[Run] = (),
    waiting: Sequence[Wait] = (),
    *,
    qos: QosConfig | None = None,
    node: str = NODE,
) -> list[Given]:
    """Given events for a node with running and waiting pods (requests 1/1: admission never binds)."""
    events: list[Given] = list(node_events(gpu_count, node=node, qos=qos))
    for pod in running:
        events.append(registered(pod.name, 1, pod.limit, priority=pod.priority, node=node))
        events.append((pod.since, PodReady(pod=ref(pod.name), node=node)))
        events.append(
            (
                pod.since,
                Assigned(
                    pod=ref(pod.name),
                    node=node,
                    gpu_index=pod.gpu,
                    gpu_uuid=gpu_uuid(pod.gpu, node),
                ),
            )
        )
    for queued in waiting:
        events.append(registered(queued.name, 1, queued.limit, priority=queued.priority, node=node))
        events.append(PodReady(pod=ref(queued.name), node=node))
    return events


def only_event(given: Sequence[Given], when: Command, *, now: datetime = T0) -> Event:
    """The one event ``when`` decides after ``given`` (decide must not touch the state)."""
    state = given_state(given)
    before = copy.deepcopy(state)
    events = decide(state, when, now)
    assert state == before, "decide mutated the state"
    assert len(events) == 1, events
    return events[0]
