"""Local mode: which user may act for which pod at the workload socket.

In Kubernetes (``--identity kernel``) the kernel names the caller's pod (its cgroup). On one
machine (``--identity request``) callers are in no pod, and the socket is open to every member
of its group, so the request's word alone would let any of them act for any pod (ask for its
GPU, be told its outcome, have it preempted). Here the caller's *uid* (``SO_PEERCRED``) is
checked against the pod's **owner**:

* the pod's ``owner_uid`` in the cluster file (``gpupool pod add`` writes the adding user's);
* else the owner of the cluster file itself (whoever wrote the file declared its pods);
* without a cluster file, no pod has an owner.

Root (uid 0) and the executor's own user may act for every pod: both can stop or trace the
executor anyway. Everyone else is refused with ``NotPodOwner``. The trust boundary is the
cluster file: whoever may write it decides who owns its pods (docs/node-executor.md).
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import yaml

from gpupool.events import PodRef


class _DeclaredPod(msgspec.Struct, kw_only=True):
    name: str
    namespace: str = "default"
    owner_uid: int | None = None


class _DeclaredPods(msgspec.Struct, kw_only=True):
    pods: list[_DeclaredPod] = []


class OwnerRefused(msgspec.Struct, frozen=True, kw_only=True):
    reason: str
    message: str


class PodOwners:
    """Pod → owner uid, read from the cluster file (again whenever the file changes)."""

    def __init__(self, cluster_file: Path | None, *, executor_uid: int | None = None) -> None:
        self.cluster_file = cluster_file
        self.executor_uid = os.getuid() if executor_uid is None else executor_uid
        self._seen: tuple[int, int, int] | None = None
        self._owners: dict[PodRef, int] = {}
        self._error = ""

    def _load(self) -> None:
        if self.cluster_file is None:
            return
        try:
            status = self.cluster_file.stat()
        except OSError as error:
            self._seen, self._owners, self._error = (
                None,
                {},
                f"cannot read {self.cluster_file}: {error}",
            )
            return
        seen = (status.st_ino, status.st_mtime_ns, status.st_size)
        if seen == self._seen:
            return
        try:
            document = yaml.safe_load(self.cluster_file.read_bytes())
            declared = msgspec.convert(document or {}, _DeclaredPods)
        except (OSError, yaml.YAMLError, msgspec.ValidationError, RecursionError) as error:
            # a file the policy service cannot read either: its pods stay as they were owned
            self._error = f"cannot read the owners in {self.cluster_file}: {error}"
            return
        self._owners = {
            PodRef(namespace=pod.namespace, name=pod.name): (
                pod.owner_uid if pod.owner_uid is not None else status.st_uid
            )
            for pod in declared.pods
        }
        self._seen, self._error = seen, ""

    def owner_of(self, pod: PodRef) -> int | None:
        self._load()
        return self._owners.get(pod)

    def authorise(self, uid: int, pod: PodRef) -> OwnerRefused | None:
        """None when ``uid`` may act for ``pod``; else why not."""
        if uid in (0, self.executor_uid):
            return None
        owner = self.owner_of(pod)
        if owner == uid:
            return None
        if owner is None:
            where = (
                f"the cluster file {self.cluster_file} declares no pod {pod}"
                if self.cluster_file is not None
                else "this executor has no cluster file naming the pods' owners"
            )
            return OwnerRefused(
                reason="NotPodOwner",
                message=f"uid {uid} may not act for pod {pod}: {where}"
                + (f" ({self._error})" if self._error else ""),
            )
        return OwnerRefused(
            reason="NotPodOwner",
            message=f"uid {uid} may not act for pod {pod}: it belongs to uid {owner}",
        )
