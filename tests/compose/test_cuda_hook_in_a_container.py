"""The CUDA hook from ``/etc/ld.so.preload`` in a real container, placed the way the kubelet places
a pod's container: under the cgroup parent ``kubepods/besteffort/pod<uid>``.

No ``LD_PRELOAD`` is set in the container, and the program is started through ``env -i`` (a
launcher that scrubs the environment): the dynamic loader still loads the hook, the hook still
asks the executor's socket for a GPU at the first ``cuInit``, and the executor still finds the
pod from the kernel (the container's cgroup) — the path a pod takes on a real node, minus the
GPU. A container in no pod cgroup is refused, and its ``cuInit`` says why.

The Docker engine, the image (the project's debootstrap base), the hook, the fake driver and the
hooked-pod logic are real; the log is the kernel-identity test's double (one pod, assigned)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_hook_harness import FAKE_DRIVER_DIR, HOOK, build
from docker_engine import NoDockerEngine, docker_engine
from test_cuda_hook_kernel_identity import GPU, POD, FakeLog, Handler

from gpupool.events import PodRef
from gpupool.node_executor.hooked_pods import HookedPods
from gpupool.node_executor.workload_socket import WorkloadSocketServer

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.docker, pytest.mark.timeout(600)]

BASE_IMAGE = "gpupool/base:bookworm"
HOOK_IN_IMAGE = "/usr/lib/gpupool/libgpupool-cuda-hook.so"
DRIVER_IN_IMAGE = "/opt/fake-cuda"
RUN_DIR = "/run/gpupool"
CGROUP_ROOT = Path("/sys/fs/cgroup")


class ContainerPodLog(FakeLog):
    """The kernel-identity test's double under a pod UID of this test's own: Docker leaves the
    cgroup parent behind, and the other test makes its pod's cgroup itself."""

    def __init__(self, pod_uid: str) -> None:
        super().__init__()
        self.state.uid = pod_uid
        self.pod_uid = pod_uid

    def pods_by_uid(self) -> dict[str, PodRef]:
        return {self.pod_uid: POD}


@pytest.fixture
def pod_uid() -> Iterator[str]:
    uid = str(uuid.uuid4())
    yield uid
    # the cgroup parent Docker made for the container, in every hierarchy
    for directory in CGROUP_ROOT.glob(f"**/kubepods/besteffort/pod{uid}"):
        with contextlib.suppress(OSError):
            directory.rmdir()


@pytest.fixture(scope="module")
def docker() -> Iterator[str]:
    try:
        with docker_engine() as cli:
            built = subprocess.run(
                ["bash", str(ROOT / "scripts" / "build-base-image.sh")],
                capture_output=True, text=True, timeout=900, check=False, cwd=ROOT,
            )  # fmt: skip
            assert built.returncode == 0, built.stderr[-4000:]
            build()
            yield cli
    except NoDockerEngine as why:
        if os.environ.get("GPUPOOL_REQUIRE_DOCKER") == "1":
            pytest.fail(f"this test needs a Docker engine: {why}")
        pytest.skip(f"no Docker engine: {why} (GPUPOOL_REQUIRE_DOCKER=1 makes this a failure)")


async def run_container(
    docker: str, run_dir: Path, driver_log: str, *, cgroup_parent: str | None
) -> tuple[int, str, str]:
    """The fake CUDA program in a container with the hook only in /etc/ld.so.preload."""
    preload = run_dir / "ld.so.preload"
    preload.write_text(HOOK_IN_IMAGE + "\n")
    argv = [
        docker, "run", "--rm", "--network", "none",
        "-v", f"{HOOK}:{HOOK_IN_IMAGE}:ro",
        "-v", f"{preload}:/etc/ld.so.preload:ro",
        "-v", f"{FAKE_DRIVER_DIR}:{DRIVER_IN_IMAGE}:ro",
        "-v", f"{run_dir}:{RUN_DIR}",
        *(["--cgroup-parent", cgroup_parent] if cgroup_parent else []),
        BASE_IMAGE,
        # a launcher that scrubs the environment: LD_PRELOAD could not survive it
        "env", "-i",
        f"LD_LIBRARY_PATH={DRIVER_IN_IMAGE}",
        f"GPUPOOL_SOCKET={RUN_DIR}/gpupool.sock",
        f"FAKE_CUDA_LOG={RUN_DIR}/{driver_log}",
        f"{DRIVER_IN_IMAGE}/cuda_program", "dlsym", "init",
    ]  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    async with asyncio.timeout(120):
        out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def visible_devices_at_init(driver_log: Path) -> list[str]:
    """What CUDA_VISIBLE_DEVICES the fake driver saw at each cuInit in this log (any pid: the
    container has its own pid namespace, and only its one process writes this log)."""
    if not driver_log.exists():
        return []
    calls = [line.split(" ", 1)[1] for line in driver_log.read_text().splitlines()]
    return [
        call.split("CUDA_VISIBLE_DEVICES=", 1)[1] for call in calls if call.startswith("cuInit ")
    ]


async def test_a_pod_container_with_the_hook_in_ld_so_preload_gets_its_pods_gpu(
    docker: str, tmp_path: Path, pod_uid: str
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_dir.chmod(0o777)
    log = ContainerPodLog(pod_uid)
    hooked = HookedPods(log)
    async with WorkloadSocketServer(run_dir / "gpupool.sock", Handler(hooked)):  # type: ignore[arg-type]
        (run_dir / "gpupool.sock").chmod(0o666)
        in_pod = await run_container(
            docker, run_dir, "pod.log", cgroup_parent=f"/kubepods/besteffort/pod{pod_uid}"
        )
        assert in_pod[0] == 0, in_pod
        async with asyncio.timeout(10):  # the pod's only GPU process ended: the GPU is released
            await log.released_once.wait()
        no_pod = await run_container(docker, run_dir, "no-pod.log", cgroup_parent=None)
        await hooked.close()

    code, stdout, stderr = in_pod
    assert stdout.splitlines() == ["cuInit 0"], in_pod
    assert visible_devices_at_init(run_dir / "pod.log") == [GPU.uuid]
    assert log.released == ["completed"]

    code, stdout, stderr = no_pod
    assert code == 0, no_pod
    assert stdout.splitlines() == ["cuInit 100"], no_pod
    (line,) = stderr.splitlines()
    assert line.startswith("gpupool: the node-executor refused this process a GPU (NotInAPod): ")
    assert visible_devices_at_init(run_dir / "no-pod.log") == []
    assert log.refusals == [(None, "NotInAPod")]
