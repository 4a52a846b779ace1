"""Every policy start submits the whole cluster again: the same rejection is recorded once.

Issue 12: "every policy start re-appends the same PodRejected for each invalid pod".
Three starts of the policy service on one log, with an invalid pod and an invalid
node in the cluster file, leave one PodRejected and one NodeRejected; a pod changed
so that another reason applies is rejected (once) for it; a pod fixed in the file
registers.
"""

from __future__ import annotations

from collections import Counter
from contextlib import AsyncExitStack
from typing import Any

import msgspec

from gpupool.eventlog import InMemoryEventLog
from gpupool.eventlog.port import StoredEvent
from gpupool.events import NodeConfigured, NodeRejected, PodRegistered, PodRejected
from gpupool.policy.local_config import LocalCluster
from gpupool.policy.service import PolicyService
from gpupool.runtime.decider import DeciderLoop


def cluster(**pod_changes: Any) -> LocalCluster:
    bad_pod = {"name": "greedy", "node": "gpu-node-1", "requests": {"core": 50, "memory": 50}}
    bad_pod.update(pod_changes)
    return msgspec.convert(
        {
            "nodes": [{"name": "gpu-node-1", "gpus": 1}, {"name": "gpu node", "gpus": 1}],
            "pods": [
                {"name": "fine", "node": "gpu-node-1", "requests": {"core": 50, "memory": 50}},
                bad_pod,
            ],
        },
        LocalCluster,
    )


async def start_policy(log: InMemoryEventLog, file: LocalCluster) -> None:
    service = PolicyService(file)
    loop = DeciderLoop(log, service="policy", projection=service.projection())
    await loop.rebuild()
    async with AsyncExitStack() as stack:
        await service.start(loop, stack)


async def recorded(log: InMemoryEventLog) -> Counter[str]:
    counts: Counter[str] = Counter()
    async for entry in log.replay():
        if isinstance(entry, StoredEvent):
            event = entry.envelope.event
            reason = getattr(event, "reason", "")
            counts[f"{type(event).__name__} {reason}".strip()] += 1
    return counts


async def test_three_policy_starts_record_each_rejection_once(memory_log: InMemoryEventLog) -> None:
    invalid = cluster(priority=2**40)
    for _ in range(3):
        await start_policy(memory_log, invalid)
    counts = await recorded(memory_log)
    assert counts[f"{PodRejected.__name__} InvalidPriority"] == 1
    assert counts[f"{NodeRejected.__name__} InvalidNodeName"] == 1
    assert counts[NodeConfigured.__name__] == 1
    assert counts[PodRegistered.__name__] == 1

    # another problem with the same pod is a new rejection: recorded (once)
    other = cluster(requests={"core": 50, "memory": 50}, limits={"core": 40, "memory": 50})
    for _ in range(2):
        await start_policy(memory_log, other)
    counts = await recorded(memory_log)
    assert counts[f"{PodRejected.__name__} LimitBelowRequest"] == 1
    assert counts[f"{PodRejected.__name__} InvalidPriority"] == 1


async def test_a_pod_fixed_in_the_file_after_its_rejection_is_registered(
    memory_log: InMemoryEventLog,
) -> None:
    await start_policy(memory_log, cluster(priority=2**40))
    await start_policy(memory_log, cluster())  # valid now: registered
    counts = await recorded(memory_log)
    assert counts[PodRegistered.__name__] == 2
    assert counts[f"{PodRejected.__name__} InvalidPriority"] == 1
