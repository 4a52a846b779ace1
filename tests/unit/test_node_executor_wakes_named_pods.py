"""The node-executor wakes, for each event of its node, only the sessions and CUDA-hooked pods
the event names (``pods_touched``); an event that names no pod wakes every one.

Before, every event of the node woke every session and every hooked pod: at N pods on a
node, N wake-ups per event, each re-reading its state for nothing (a hooked pod also
starting and cancelling a watcher task per waiter).
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from gpupool.eventlog.port import StoredEvent
from gpupool.events import (
    Assigned,
    Envelope,
    Event,
    GpuInventoryReported,
    NodeConfigured,
    PodReady,
    PodRef,
    Preempted,
    QosConfig,
    Released,
)
from gpupool.gpus import simulated_inventory
from gpupool.node_executor.hooked_pods import HookedPod
from gpupool.node_executor.inventory import sampler_for
from gpupool.node_executor.processes import ProcessSupervisor
from gpupool.node_executor.service import NodeExecutor, PodSession

NODE = "n1"
T0 = datetime(2025, 4, 22, 8, 0, 0, tzinfo=UTC)
A, B, C = (PodRef(namespace="default", name=name) for name in "abc")
HOOKED = PodRef(namespace="default", name="hooked")


def executor_with_sessions(tmp_path: Path) -> NodeExecutor:
    inventory = simulated_inventory(2, node=NODE)
    executor = NodeExecutor(
        node=NODE,
        inventory=inventory,
        socket_path=tmp_path / "gpupool.sock",
        sampler=sampler_for(inventory),
        supervisor=ProcessSupervisor(),
    )
    for pod in (A, B, C):
        executor.sessions[pod] = PodSession(pod=pod)
    executor.hooked._pods[HOOKED] = HookedPod(pod=HOOKED)
    return executor


async def woken_by(executor: NodeExecutor, event: Event) -> set[PodRef]:
    for session in executor.sessions.values():
        session.change.clear()
    for hooked in executor.hooked._pods.values():
        hooked.change.clear()
    envelope = Envelope(id="e-1", time=T0, event=event)
    await executor.react(StoredEvent(seq=1, subject=f"gpupool.log.{NODE}", envelope=envelope))
    woken = {pod for pod, session in executor.sessions.items() if session.change.is_set()}
    return woken | {pod for pod, hooked in executor.hooked._pods.items() if hooked.change.is_set()}


async def test_an_event_of_one_pod_wakes_that_pods_session_alone(tmp_path: Path) -> None:
    executor = executor_with_sessions(tmp_path)
    gpu = simulated_inventory(2, node=NODE).gpus[0]
    assert await woken_by(executor, PodReady(pod=A, node=NODE)) == {A}
    assigned = Assigned(pod=B, node=NODE, gpu_index=0, gpu_uuid=gpu.uuid)
    assert await woken_by(executor, assigned) == {B}
    released = Released(pod=C, node=NODE, reason="completed", gpu_index=0, gpu_uuid=gpu.uuid)
    assert await woken_by(executor, released) == {C}
    assert await woken_by(executor, PodReady(pod=HOOKED, node=NODE)) == {HOOKED}


async def test_a_preemption_wakes_its_victim_and_its_preemptor(tmp_path: Path) -> None:
    executor = executor_with_sessions(tmp_path)
    gpu = simulated_inventory(2, node=NODE).gpus[1]
    preempted = Preempted(
        victim=A, preemptor=HOOKED, node=NODE, gpu_index=1, gpu_uuid=gpu.uuid, reason="priority"
    )
    assert await woken_by(executor, preempted) == {A, HOOKED}


async def test_an_event_naming_no_pod_wakes_every_session_and_hooked_pod(tmp_path: Path) -> None:
    executor = executor_with_sessions(tmp_path)
    inventory = simulated_inventory(1, node=NODE)
    every = {A, B, C, HOOKED}
    reported = GpuInventoryReported(node=NODE, gpus=inventory.gpus, source="simulated")
    assert await woken_by(executor, reported) == every
    configured = NodeConfigured(node=NODE, policy="share-pool", qos=QosConfig(), gpu_count=1)
    assert await woken_by(executor, configured) == every


async def test_another_nodes_event_wakes_nobody(tmp_path: Path) -> None:
    executor = executor_with_sessions(tmp_path)
    assert await woken_by(executor, PodReady(pod=A, node="n2")) == set()
