"""Kubernetes mode (--identity kernel): the CUDA hook names no pod; the executor takes the pod
from the kernel — the connecting process's cgroup, named by the kubelet after the pod's UID.
A real hooked process in a cgroup ``kubepods/besteffort/pod<uid>`` is granted its pod's GPU; a
process in no pod is refused, and its cuInit says why.

The socket, the hook, the fake driver and the hooked-pod logic are real; the log is a test
double (``FakeLog``): one pod, already assigned to GPU 2."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from cuda_hook_harness import start_hooked, visible_devices_at_init

from gpupool.core import PodState
from gpupool.events import GpuInfo, PodRef, ReleaseReason, Share
from gpupool.node_executor.hooked_pods import HookedPods
from gpupool.node_executor.peer_identity import IdentityMode
from gpupool.node_executor.workload_socket import WorkloadSocketServer
from gpupool.workload import AttachRequest, Rejected, RunRequest, StdioFds, Waiting

pytestmark = pytest.mark.integration

POD = PodRef(namespace="team-a", name="notebook")
POD_UID = str(uuid.uuid4())
GPU = GpuInfo(index=2, uuid="GPU-SIMULATED-node-1-2", memory_mib=81559)


def pod_cgroup() -> Path | None:
    """A cgroup directory named like the kubelet's for POD_UID, in a hierarchy we may write."""
    for hierarchy in ("/sys/fs/cgroup/pids", "/sys/fs/cgroup/unified", "/sys/fs/cgroup"):
        base = Path(hierarchy)
        if not (base / "cgroup.procs").exists():
            continue
        path = base / "kubepods" / "besteffort" / f"pod{POD_UID}"
        try:
            path.mkdir(parents=True)
        except OSError:
            continue
        return path
    return None


@pytest.fixture
def cgroup() -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("needs root to make a pod cgroup")
    path = pod_cgroup()
    if path is None:
        pytest.skip("no writable cgroup hierarchy")
    yield path
    for directory in (path, path.parent, path.parent.parent):
        with contextlib.suppress(OSError):
            directory.rmdir()


class FakeLog:
    """The executor as the hooked pods see it: one pod, running on GPU 2."""

    identity: IdentityMode = "kernel"

    def __init__(self) -> None:
        now = datetime.now(UTC)
        self.state = PodState(
            ref=POD,
            node="node-1",
            policy="share-pool",
            requests=Share(core=25, memory=25),
            limits=Share(core=50, memory=50),
            priority=0,
            uid=POD_UID,
            registered_at=now,
            phase="running",
            gpu_index=GPU.index,
            gpu_uuid=GPU.uuid,
            running_since=now,
        )
        self.released: list[ReleaseReason] = []
        self.released_once = asyncio.Event()
        self.refusals: list[tuple[PodRef | None, str]] = []

    def pod(self, ref: PodRef) -> PodState | None:
        return self.state if ref == POD else None

    def runs_command(self, ref: PodRef) -> bool:
        return False

    def pods_by_uid(self) -> dict[str, PodRef]:
        return {POD_UID: POD}

    async def record_refusal(
        self, pod: PodRef | None, reason: str, message: str, channel: object = None
    ) -> None:
        self.refusals.append((pod, reason))

    async def request_gpu(self, pod: PodRef) -> Rejected | None:
        raise AssertionError("the pod already runs: nobody should ask again")

    async def release(self, pod: PodRef, reason: ReleaseReason, exit_code: int | None) -> None:
        self.released.append(reason)
        self.state.phase = "dormant"
        self.released_once.set()

    def waiting(self, state: PodState) -> Waiting:
        return Waiting(seconds=0, position=1)

    def message_period(self) -> float:
        return 1.0

    def grace_seconds(self) -> float:
        return 1.0

    def gpu(self, index: int) -> GpuInfo:
        assert index == GPU.index
        return GPU


class Handler:
    def __init__(self, hooked: HookedPods) -> None:
        self._hooked = hooked

    async def handle(self, request: RunRequest, fds: StdioFds, channel: object) -> None:
        raise AssertionError("no RunRequest in this test")

    async def attach(self, request: AttachRequest, channel: object) -> None:
        await self._hooked.attach(request, channel)  # type: ignore[arg-type]


async def test_the_pod_comes_from_the_callers_cgroup_and_others_are_refused(
    tmp_path: Path, cgroup: Path
) -> None:
    log = FakeLog()
    hooked = HookedPods(log)
    driver_log = tmp_path / "driver.log"
    socket = tmp_path / "gpupool.sock"
    procs = str(cgroup / "cgroup.procs")

    def join_pod_cgroup() -> None:  # in the child, before exec: the kubelet's doing in a pod
        with open(procs, "w") as file:
            file.write(str(os.getpid()))

    async with WorkloadSocketServer(socket, Handler(hooked)):  # type: ignore[arg-type]
        inside = await start_hooked(
            socket, None, ["init"], driver_log=driver_log, preexec_fn=join_pod_cgroup
        )
        outside = await start_hooked(socket, None, ["init"], driver_log=driver_log)
        assert await inside.exit_code() == 0, inside.stderr
        assert await outside.exit_code() == 0
        async with asyncio.timeout(10):  # the last (only) GPU process of the pod ended
            await log.released_once.wait()
        await hooked.close()

    assert inside.stdout == ["cuInit 0"]
    assert visible_devices_at_init(driver_log, inside.pid) == [GPU.uuid]
    assert log.released == ["completed"]
    assert outside.stdout == ["cuInit 100"]
    (line,) = outside.stderr
    assert line.startswith("gpupool: the node-executor refused this process a GPU (NotInAPod): ")
    assert visible_devices_at_init(driver_log, outside.pid) == []
    assert log.refusals == [(None, "NotInAPod")]  # a MessageRejected: no pod to name
