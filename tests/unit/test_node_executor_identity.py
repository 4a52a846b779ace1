"""Which pod a caller of the workload socket may act for (pure rule, table-tested)."""

from __future__ import annotations

import pytest

from gpupool.events import PodRef
from gpupool.node_executor.peer_identity import (
    IdentityMode,
    IdentityRefused,
    PeerIdentity,
    pod_of_peer,
)

A = PodRef(namespace="team", name="a")
B = PodRef(namespace="team", name="b")
UID_A = "0f5b3a7e-1c2d-4e5f-8a9b-0c1d2e3f4a5b"
IN_A = PeerIdentity(
    pid=10, uid=1000, gid=1000, cgroup="/kubepods/pod" + UID_A + "/c1", pod_uid=UID_A
)
OUTSIDE = PeerIdentity(pid=11, uid=1000, gid=1000, cgroup="/user.slice/session-1.scope")
STRANGER = PeerIdentity(
    pid=12,
    uid=0,
    gid=0,
    cgroup="/kubepods/podffffffff-ffff-ffff-ffff-ffffffffffff/c",
    pod_uid="ffffffff-ffff-ffff-ffff-ffffffffffff",
)


@pytest.mark.parametrize(
    ("mode", "claimed", "peer", "expected"),
    [
        pytest.param("request", B, OUTSIDE, B, id="local-mode-trusts-the-request"),
        pytest.param("kernel", A, IN_A, A, id="kernel-agrees"),
        pytest.param("kernel", B, IN_A, "IdentityMismatch", id="cannot-ask-for-another-pod"),
        pytest.param("kernel", A, OUTSIDE, "NotInAPod", id="not-in-a-pod"),
        pytest.param("kernel", A, STRANGER, "UnknownPodUid", id="pod-not-registered"),
    ],
)
def test_pod_of_peer(
    mode: IdentityMode, claimed: PodRef, peer: PeerIdentity, expected: object
) -> None:
    result = pod_of_peer(mode, claimed, peer, {UID_A: A})
    if isinstance(expected, str):
        assert isinstance(result, IdentityRefused)
        assert result.reason == expected
        assert (
            str(peer.pid) in result.message
            or str(claimed) in result.message
            or peer.pod_uid in result.message
        )
    else:
        assert result == expected
