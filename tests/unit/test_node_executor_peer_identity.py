"""Pod identity from the kernel: kubelet cgroup paths (both drivers) to pod UIDs."""

from __future__ import annotations

import os
import socket

import pytest

from gpupool.node_executor.peer_identity import cgroup_of, identify_peer, pod_uid_from_cgroup

UID = "3f2b6c1e-8d4a-4b7e-9c0d-12ab34cd56ef"
UNDERSCORED = UID.replace("-", "_")
CONTAINER = "0123456789abcdef" * 4


@pytest.mark.parametrize(
    ("path", "uid"),
    [
        pytest.param(f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UNDERSCORED}.slice/cri-containerd-{CONTAINER}.scope", UID, id="systemd-burstable"),
        pytest.param(f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UNDERSCORED}.slice/crio-{CONTAINER}.scope", UID, id="systemd-besteffort-crio"),
        pytest.param(f"/kubepods.slice/kubepods-pod{UNDERSCORED}.slice/cri-containerd-{CONTAINER}.scope", UID, id="systemd-guaranteed"),
        pytest.param(f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UNDERSCORED}.slice", UID, id="systemd-pod-level"),
        pytest.param(f"/kubepods/burstable/pod{UID}/{CONTAINER}", UID, id="cgroupfs-burstable"),
        pytest.param(f"/kubepods/besteffort/pod{UID}/{CONTAINER}", UID, id="cgroupfs-besteffort"),
        pytest.param(f"/kubepods/pod{UID}/{CONTAINER}", UID, id="cgroupfs-guaranteed"),
        pytest.param(f"/kubepods-burstable-pod{UNDERSCORED}.slice:cri-containerd:{CONTAINER}", UID, id="containerd-systemd-short"),
        pytest.param(f"/system.slice/kubelet.service/kubepods/burstable/pod{UID}/{CONTAINER}", UID, id="nested-under-kubelet"),
        pytest.param("/", None, id="root-or-own-cgroup-namespace"),
        pytest.param("/user.slice/user-1000.slice/session-3.scope", None, id="login-session"),
        pytest.param("/system.slice/containerd.service", None, id="system-service"),
        pytest.param(f"/docker/pod{UID}", None, id="pod-word-outside-kubepods"),
        pytest.param("/kubepods/burstable/podnot-a-uid/abc", None, id="not-a-uid"),
        pytest.param("/kubepods.slice/kubepods-burstable.slice", None, id="qos-level-only"),
        pytest.param(f"/kubepods/burstable/pod{UID}x/{CONTAINER}", None, id="uid-with-trailing-junk"),
    ],
)  # fmt: skip
def test_pod_uid_from_cgroup(path: str, uid: str | None) -> None:
    assert pod_uid_from_cgroup(path) == uid


def test_cgroup_of_this_process_and_of_nobody() -> None:
    with open("/proc/self/cgroup") as cgroups:
        lines = cgroups.read().splitlines()
    assert cgroup_of(os.getpid()) in {line.split(":", 2)[2] for line in lines}
    assert cgroup_of(2**22 + 12345) == ""  # beyond pid_max: no such process


def test_identify_peer_over_a_socketpair() -> None:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with left, right:
        peer = identify_peer(left)
    assert (peer.pid, peer.uid, peer.gid) == (os.getpid(), os.getuid(), os.getgid())
    assert peer.cgroup == cgroup_of(os.getpid())
    assert peer.pod_uid == pod_uid_from_cgroup(peer.cgroup)
