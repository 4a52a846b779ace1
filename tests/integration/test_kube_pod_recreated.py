"""A pod recreated under the name of one still releasing, against kmock.

The old pod held a GPU when it was deleted: its slot stays taken until the node
executor reports its processes gone (``Released``). The new pod (same name, new UID)
is refused with ``PreviousPodReleasing`` meanwhile, and the refusal is a Warning
Event on it; once the old one's ``Released`` reaches the policy service
(``PolicyService.react``), the pod controller submits the new pod again and it is
registered, once.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import kmock
from kube_harness import (
    POLICY_LABEL,
    SOURCE_NODE,
    PolicyInKubernetesMode,
    kubectl,
    node_object,
    policy_in_kubernetes_mode,
    share_pod,
)

from gpupool.core import ReportInventory, ReportRelease, RequestGpu, Schedule
from gpupool.eventlog.port import StoredEvent
from gpupool.events import (
    Assigned,
    Envelope,
    GpuInfo,
    PodRef,
    PodRegistered,
    PodRejected,
    PodRemoved,
    Released,
)
from gpupool.policy.service import PolicyService

PODS = "/api/v1/namespaces/default/pods"
NAME = "train-0"
POD = PodRef(namespace="default", name=NAME)


def registrations(world: PolicyInKubernetesMode) -> list[str]:
    return [e.uid for e in world.core.events if isinstance(e, PodRegistered) and e.pod == POD]


def refusals(world: PolicyInKubernetesMode) -> list[str]:
    return [e.reason for e in world.core.events if isinstance(e, PodRejected) and e.pod == POD]


def warnings_on_pod(world: PolicyInKubernetesMode) -> list[dict[str, Any]]:
    return [e for e in world.events() if e["involvedObject"]["name"] == NAME]


def policy_service_of(world: PolicyInKubernetesMode) -> PolicyService:
    """The policy service's reaction to the log, over this world's controllers and core."""
    service = PolicyService(None)
    service.controllers = world.controllers
    # the service's decider loop, as far as ``react`` reads it: the folded state
    service._loop = cast(Any, SimpleNamespace(projection=SimpleNamespace(state=world.core.state)))
    return service


async def test_a_pod_recreated_while_its_namesake_releases_registers_once_it_is_released(
    kmock: kmock.KubernetesEmulator,
) -> None:
    await kubectl(kmock, "POST", "/api/v1/nodes", node_object(labels={POLICY_LABEL: "share-pool"}))
    await kubectl(kmock, "POST", PODS, share_pod(NAME, uid="uid-old"))
    async with policy_in_kubernetes_mode(kmock) as world:
        await world.until(lambda: registrations(world) == ["uid-old"])
        core = world.core
        gpu = GpuInfo(index=0, uuid="GPU-8f3c", memory_mib=81920)
        await core(ReportInventory(node=SOURCE_NODE, gpus=(gpu,), source="simulated"))
        await core(RequestGpu(pod=POD, node=SOURCE_NODE))
        assert [type(e) for e in await core(Schedule(node=SOURCE_NODE))] == [Assigned]

        # deleted while it runs: removed, but releasing until its processes are gone
        await kubectl(kmock, "DELETE", f"{PODS}/{NAME}")
        await world.until(lambda: any(isinstance(e, PodRemoved) for e in core.events))
        assert core.state.pods[POD].removed

        # recreated under the same name with a new UID: refused, with a Warning Event
        await kubectl(kmock, "POST", PODS, share_pod(NAME, uid="uid-new"))
        await world.until(lambda: refusals(world) == ["PreviousPodReleasing"])
        await world.until(lambda: len(warnings_on_pod(world)) == 1)
        (warning,) = warnings_on_pod(world)
        assert (warning["type"], warning["reason"]) == ("Warning", "PreviousPodReleasing")
        assert registrations(world) == ["uid-old"]

        # an unrelated Released (another pod) retries nothing
        service = policy_service_of(world)
        other = Released(
            pod=PodRef(namespace="default", name="other"), node=SOURCE_NODE, reason="completed"
        )
        await service.react(
            StoredEvent(
                seq=1, subject="s", envelope=Envelope(id="e1", time=world.clock(), event=other)
            )
        )
        assert registrations(world) == ["uid-old"] and refusals(world) == ["PreviousPodReleasing"]

        # the node executor reports the old pod's processes gone: Released, the slot is free
        released = await core(ReportRelease(pod=POD, node=SOURCE_NODE, reason="completed"))
        (event,) = [e for e in released if isinstance(e, Released)]
        assert POD not in core.state.pods
        await service.react(
            StoredEvent(
                seq=2, subject="s", envelope=Envelope(id="e2", time=world.clock(), event=event)
            )
        )
        await world.until(lambda: registrations(world) == ["uid-old", "uid-new"])
        assert core.state.pods[POD].uid == "uid-new"

        # the same Released seen again (a redelivery) registers nothing more
        await service.react(
            StoredEvent(
                seq=2, subject="s", envelope=Envelope(id="e2", time=world.clock(), event=event)
            )
        )
        assert registrations(world) == ["uid-old", "uid-new"]
        assert refusals(world) == ["PreviousPodReleasing"]
