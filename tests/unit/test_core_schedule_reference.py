"""schedule, reading the indexes evolve keeps, decides what the queue rebuilt from scratch decides.

``schedule`` reads the node's usage through the inventory (``_Inventory.usage_of``: one
lookup when every GPU has pods running), updates it as a tuple while it serves the queue,
and asks the memoised ``choose_gpu_in_order``. The reference below rebuilds everything
from the pods on every call: the ready queue (``ready_queue``), the usage of the
inventory's GPUs (``gpu_usage``), the node's workload (``node_workload``) and
``choose_gpu`` on a dict, served strictly in order (backfill: past the head, away from
its reservation). On seeded random scenarios with 1- to 16-GPU nodes, mixed shares,
priorities, backfill and preemption, both decide the same at every settle of every node.
"""

from __future__ import annotations

import random
from datetime import datetime

import pytest

from gpupool.core.decide import _inventory, schedule
from gpupool.core.placement import (
    add,
    choose_gpu,
    gpu_usage,
    node_workload,
    ready_queue,
    reservation_gpu,
)
from gpupool.core.simulation import (
    Scenario,
    ScenarioAction,
    ScenarioNode,
    ScenarioPod,
    ScenarioShare,
    Simulator,
)
from gpupool.core.state import State
from gpupool.events import Assigned, Event, GpuInfo, Share

QOS = (
    None,
    '{"backfill": true}',
    '{"preemptEnabled": true, "podMaxDurationMinutes": 4}',
    '{"backfill": true, "preemptEnabled": true}',
)


def reference_schedule(state: State, node_name: str) -> list[Event]:
    node = state.nodes.get(node_name)
    if node is None or node.policy != "share-pool" or not node.gpus:
        return []
    queue = ready_queue(state, node_name)
    pods = state.pods_on(node_name)
    usage = gpu_usage(node, pods)
    workload = node_workload(pods)
    uuids = {gpu.index: gpu.uuid for gpu in node.gpus}
    events: list[Event] = []
    position = 0
    while position < len(queue):
        pod = queue[position]
        gpu = choose_gpu(usage, pod.limits, workload=workload)
        if gpu is None:
            break
        events.append(Assigned(pod=pod.ref, node=node_name, gpu_index=gpu, gpu_uuid=uuids[gpu]))
        usage[gpu] = add(usage[gpu], pod.limits)
        position += 1
    if position < len(queue) and node.qos.backfill:
        reserved = reservation_gpu(usage, queue[position], pods)
        for pod in queue[position + 1 :]:
            gpu = choose_gpu(usage, pod.limits, exclude=reserved, workload=workload)
            if gpu is None:
                continue
            events.append(Assigned(pod=pod.ref, node=node_name, gpu_index=gpu, gpu_uuid=uuids[gpu]))
            usage[gpu] = add(usage[gpu], pod.limits)
    return events


class ComparingSimulator(Simulator):
    """Before settling a node, schedule and the reference must agree on its state."""

    compared = 0
    assigning = 0

    def _settle(self, node: str, now: datetime) -> None:
        decided = schedule(self.state, node, now)
        assert decided == reference_schedule(self.state, node), (node, now)
        self.compared += 1
        self.assigning += bool(decided)
        super()._settle(node, now)


def random_scenario(seed: int) -> Scenario:
    rng = random.Random(seed)
    nodes = [
        ScenarioNode(name=f"n{n}", gpus=rng.choice([1, 2, 8, 16]), qos=rng.choice(QOS))
        for n in range(rng.randint(1, 3))
    ]
    pods: list[ScenarioPod] = []
    timeline: list[ScenarioAction] = []
    for p in range(rng.randint(10, 80)):
        node = rng.choice(nodes)
        limit = rng.choice([5, 10, 15, 20, 25, 30, 40, 50, 60, 75, 100])
        pods.append(
            ScenarioPod(
                name=f"pod-{p}",
                node=node.name,
                requests=ScenarioShare(core=1, memory=1),
                limits=ScenarioShare(core=limit, memory=rng.choice([limit, rng.randint(1, 100)])),
                priority=rng.choice([0, 0, 1, -1]),
                requeue=rng.random() < 0.2,
            )
        )
        at = 0.0
        for _ in range(rng.randint(1, 4)):
            at += rng.expovariate(1 / 60)
            action = rng.choice(["ready", "ready", "ready", "cancel", "delete"])
            timeline.append(
                ScenarioAction(
                    at=round(at, 3),
                    action=action,  # type: ignore[arg-type]
                    pod=f"pod-{p}",
                    runs_for=round(rng.expovariate(1 / 240), 3) if action == "ready" else None,
                )
            )
    return Scenario(nodes=nodes, pods=pods, timeline=timeline, max_events=50_000)


@pytest.mark.parametrize("seed", range(30))
def test_schedule_decides_what_the_queue_rebuilt_from_scratch_decides(seed: int) -> None:
    simulator = ComparingSimulator(random_scenario(seed))
    simulator.run()
    assert simulator.compared > 10
    assert simulator.assigning > 0


def test_the_random_scenarios_assign_on_big_nodes_with_many_choices() -> None:
    """The comparison above sees decisions where the fragmentation measure picks the GPU."""
    assigned_on_big_nodes = 0
    for seed in range(30):
        scenario = random_scenario(seed)
        big = {node.name for node in scenario.nodes if node.gpus >= 8}
        for envelope in Simulator(scenario).run():
            event = envelope.event
            assigned_on_big_nodes += isinstance(event, Assigned) and event.node in big
    assert assigned_on_big_nodes > 200


@pytest.mark.parametrize("seed", range(10))
def test_the_inventorys_usage_is_each_gpus_usage_in_order(seed: int) -> None:
    """``usage_of``: the usage of the inventory's GPUs in index order, nothing for a GPU
    without an entry, whatever else the usage holds (a vanished GPU's slot)."""
    rng = random.Random(seed)
    for _ in range(200):
        indexes = rng.sample(range(20), rng.randint(1, 16))
        gpus = tuple(GpuInfo(index=i, uuid=f"GPU-{i}", memory_mib=1024) for i in indexes)
        usage = {
            index: Share(core=rng.randint(1, 100), memory=rng.randint(0, 100))
            for index in rng.sample(range(22), rng.randint(0, 18))
        }
        expected = tuple(usage.get(index, Share(core=0, memory=0)) for index in sorted(indexes))
        assert _inventory(gpus).usage_of(usage) == expected
