"""The pod watch cache: UIDs to pods (workload identity), exclusive-GPU pods and share usage by node."""

from __future__ import annotations

from typing import Any

import msgspec

from gpupool.core import PodManifest
from gpupool.core.validation import ContainerResources
from gpupool.events import PodRef, Share
from gpupool.kube.listwatch import Reflector
from gpupool.kube.pod_directory import PodDirectory, pod_manifest
from gpupool.kube.records import Change, Node, Pod


def pod(name: str, uid: str, node: str = "n1", phase: str = "Running", **resources: str) -> Pod:
    raw: dict[str, Any] = {
        "metadata": {"name": name, "namespace": "team-a", "uid": uid, "resourceVersion": "1"},
        "spec": {
            "nodeName": node,
            "containers": [
                {"name": "main", "resources": {"requests": resources, "limits": resources}}
            ],
        },
        "status": {"phase": phase},
    }
    return msgspec.convert(raw, Pod)


def share(name: str, uid: str, percent: str, **kw: Any) -> Pod:
    return pod(
        name,
        uid,
        **kw,
        **{
            "alibabacloud.com/gpu-core.percentage": percent,
            "alibabacloud.com/gpu-memory.percentage": percent,
        },
    )


def directory(*pods: Pod) -> PodDirectory:
    found = PodDirectory()
    for p in pods:
        found.apply(Change(type="ADDED", object=p))
    return found


def test_by_uid_maps_a_pod_uid_to_namespace_and_name() -> None:
    pods = directory(share("notebook", "0d1c-77", "10"), pod("web", "9a2e-01", cpu="1"))
    assert pods.by_uid("0d1c-77") == PodRef(namespace="team-a", name="notebook")
    assert pods.by_uid("unknown") is None
    pods.apply(Change(type="DELETED", object=share("notebook", "0d1c-77", "10")))
    assert pods.by_uid("0d1c-77") is None
    # recreated under the same name: a new UID
    pods.apply(Change(type="ADDED", object=share("notebook", "5f00-42", "10")))
    assert pods.by_uid("5f00-42") == PodRef(namespace="team-a", name="notebook")


def test_exclusive_gpu_pods_on_a_node() -> None:
    pods = directory(
        pod("trainer", "u1", **{"nvidia.com/gpu": "8"}),
        pod("idle", "u2", **{"nvidia.com/gpu": "0"}),
        pod("finished", "u3", phase="Succeeded", **{"nvidia.com/gpu": "1"}),
        pod("elsewhere", "u4", node="n2", **{"nvidia.com/gpu": "1"}),
        share("notebook", "u5", "10"),
        pod("web", "u6", cpu="2"),
    )
    assert pods.exclusive_gpu_pods("n1") == ("team-a/trainer",)
    # moved (a MODIFIED that changes nodeName) and gone
    pods.apply(
        Change(type="MODIFIED", object=pod("trainer", "u1", node="n2", **{"nvidia.com/gpu": "8"}))
    )
    assert pods.exclusive_gpu_pods("n1") == ()
    assert pods.exclusive_gpu_pods("n2") == ("team-a/elsewhere", "team-a/trainer")


def test_share_usage_counts_live_bound_share_pods() -> None:
    pods = directory(
        share("a", "u1", "30"),
        share("b", "u2", "25"),
        share("done", "u3", "40", phase="Failed"),
        share("other-node", "u4", "50", node="n2"),
        share("pending", "u5", "50", node=""),
    )
    assert pods.share_usage("n1") == Share(core=55, memory=55)
    assert pods.share_usage("n1", excluding=PodRef(namespace="team-a", name="a")) == Share(
        core=25, memory=25
    )


def test_pod_manifest_carries_priority_and_resources() -> None:
    raw = msgspec.json.encode(
        {
            "metadata": {"name": "p", "namespace": "ns", "uid": "u", "labels": {"k": "v"}},
            "spec": {
                "nodeName": "n1",
                "priority": 1000,
                "containers": [
                    {"name": "c", "resources": {"requests": {"cpu": "5"}, "limits": {"cpu": 5}}}
                ],
            },
        }
    )
    assert pod_manifest(msgspec.json.decode(raw, type=Pod)) == PodManifest(
        namespace="ns",
        name="p",
        node="n1",
        uid="u",
        labels={"k": "v"},
        priority=1000,
        containers=(ContainerResources(name="c", requests={"cpu": "5"}, limits={"cpu": 5}),),
    )


def test_reflector_turns_a_relist_into_changes_and_drops_replays() -> None:
    def node(name: str, version: str) -> Node:
        return msgspec.convert({"metadata": {"name": name, "resourceVersion": version}}, Node)

    reflector: Reflector[Node] = Reflector()
    assert [c.type for c in reflector.relist([node("a", "1"), node("b", "2")])] == [
        "ADDED",
        "ADDED",
    ]
    assert reflector.observe("ADDED", node("a", "1")) is None  # a replay
    change = reflector.observe("MODIFIED", node("a", "3"))
    assert change is not None and change.type == "MODIFIED"
    assert reflector.observe("DELETED", node("zz", "4")) is None  # never known
    relisted = reflector.relist([node("a", "3"), node("c", "5")])
    assert [(c.type, c.object.name) for c in relisted] == [("DELETED", "b"), ("ADDED", "c")]
