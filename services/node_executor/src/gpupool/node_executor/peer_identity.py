"""Who is on the other end of the workload socket, according to the kernel (not the request).

``SO_PEERCRED`` gives the connecting process's pid, uid and gid (as they were at ``connect``);
``/proc/<pid>/cgroup`` gives its cgroup, and in Kubernetes the kubelet names pod cgroups after
the pod's UID. So the pod a request really comes from can be checked against the pod it names.
"""

from __future__ import annotations

import re
import socket
import struct
from collections.abc import Mapping
from typing import Literal

import msgspec

from gpupool.events import PodRef

_UCRED = struct.Struct("3i")

_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
_POD_SEGMENT = re.compile(
    # cgroupfs driver:  /kubepods[/burstable|/besteffort]/pod<uid>/<container>
    # systemd driver:   .../kubepods[-burstable|-besteffort]-pod<uid_with_underscores>.slice/...
    rf"(?:^|/)(?:pod|kubepods(?:-[a-z]+)*-pod)(?P<uid>{_UID})(?:\.slice)?(?=$|[/:])"
)


class PeerIdentity(msgspec.Struct, frozen=True, kw_only=True):
    """The connecting process, as the kernel reports it."""

    pid: int
    uid: int
    gid: int
    cgroup: str = ""
    """Its cgroup path (cgroup v2 unified path, or the v1 hierarchy that names a pod); "" if unknown."""
    pod_uid: str | None = None
    """The Kubernetes pod UID parsed from ``cgroup``; None outside a kubelet-managed pod."""


def pod_uid_from_cgroup(path: str) -> str | None:
    """The pod UID in a kubelet cgroup path (``_`` of the systemd form turned back into ``-``).

    Only paths under a ``kubepods`` hierarchy count; anything else is None.
    """
    if "kubepods" not in path:
        return None
    matches = list(_POD_SEGMENT.finditer(path))
    if not matches:
        return None
    return matches[-1].group("uid").replace("_", "-")


def cgroup_of(pid: int) -> str:
    """The cgroup path of ``pid``: the first one naming a pod, else the v2 unified one ("" if unreadable)."""
    try:
        with open(f"/proc/{pid}/cgroup") as cgroups:
            lines = cgroups.read().splitlines()
    except OSError:
        return ""
    paths = [line.split(":", 2)[2] for line in lines if line.count(":") >= 2]
    for path in paths:
        if pod_uid_from_cgroup(path):
            return path
    unified = [line.split(":", 2)[2] for line in lines if line.startswith("0::")]
    return unified[0] if unified else (paths[0] if paths else "")


def identify_peer(connection: socket.socket) -> PeerIdentity:
    """SO_PEERCRED of a connected Unix socket, with the peer's cgroup and pod UID."""
    pid, uid, gid = _UCRED.unpack(
        connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    )
    cgroup = cgroup_of(pid) if pid > 0 else ""
    return PeerIdentity(
        pid=pid, uid=uid, gid=gid, cgroup=cgroup, pod_uid=pod_uid_from_cgroup(cgroup)
    )


IdentityMode = Literal["kernel", "request"]
"""``kernel``: the pod is the one whose UID the caller's cgroup names (Kubernetes);
``request``: the pod named in the request (local mode, where callers are not in pods)."""


class IdentityRefused(msgspec.Struct, frozen=True, kw_only=True):
    reason: str
    message: str


def pod_of_peer(
    mode: IdentityMode,
    claimed: PodRef,
    peer: PeerIdentity,
    pods_by_uid: Mapping[str, PodRef],
) -> PodRef | IdentityRefused:
    """Which pod a caller may act for. In ``kernel`` mode the claim must match the kernel's
    answer; nobody can ask for a GPU on another pod's behalf."""
    if mode == "request":
        return claimed
    if peer.pod_uid is None:
        return IdentityRefused(
            reason="NotInAPod",
            message=f"the caller (pid {peer.pid}, cgroup {peer.cgroup or '?'}) is not in a "
            "Kubernetes pod; only pods may use this node's GPUs",
        )
    actual = pods_by_uid.get(peer.pod_uid)
    if actual is None:
        return IdentityRefused(
            reason="UnknownPodUid",
            message=f"pod UID {peer.pod_uid} of the caller is not a registered GPU-sharing pod",
        )
    if actual != claimed:
        return IdentityRefused(
            reason="IdentityMismatch",
            message=f"the caller belongs to pod {actual}, not {claimed}",
        )
    return actual
