"""The workload's environment: one GPU by UUID, limits handed to CUDA MPS, the pod named."""

from __future__ import annotations

import pytest

from gpupool.events import GpuInfo, PodRef, Share
from gpupool.node_executor.environment import (
    memory_limit_bytes,
    memory_limit_mib,
    workload_environment,
)

H100 = GpuInfo(index=6, uuid="GPU-5a1b0c3e-aaaa-bbbb-cccc-000000000006", memory_mib=81559)
POD = PodRef(namespace="ml", name="bert")


def test_environment_names_the_gpu_and_the_limits() -> None:
    env = workload_environment({"HOME": "/home/u"}, H100, Share(core=40, memory=50), pod=POD)
    assert env == {
        "HOME": "/home/u",
        "CUDA_VISIBLE_DEVICES": "GPU-5a1b0c3e-aaaa-bbbb-cccc-000000000006",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=40779M",
        "GPUPOOL_POD": "ml/bert",
        "GPUPOOL_GPU_INDEX": "6",
        "GPUPOOL_GPU_UUID": "GPU-5a1b0c3e-aaaa-bbbb-cccc-000000000006",
    }


def test_client_cannot_choose_devices_or_loosen_limits() -> None:
    client_env = {
        "CUDA_VISIBLE_DEVICES": "0,1,2,3",
        "NVIDIA_VISIBLE_DEVICES": "all",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100",
        "CUDA_MPS_PIPE_DIRECTORY": "/tmp/my-own-mps",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=999999M",
        "CUDA_LAUNCH_BLOCKING": "1",
    }
    env = workload_environment(
        client_env, H100, Share(core=10, memory=10), pod=POD, mps_pipe_directory="/run/mps"
    )
    assert env["CUDA_VISIBLE_DEVICES"] == H100.uuid
    assert "NVIDIA_VISIBLE_DEVICES" not in env
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "10"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8155M"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/run/mps"
    assert env["CUDA_LAUNCH_BLOCKING"] == "1"  # unrelated CUDA settings are the client's


@pytest.mark.parametrize(
    ("memory_mib", "percent", "mib"),
    [
        pytest.param(81559, 100, 81559, id="whole-card"),
        pytest.param(81559, 25, 20389, id="floored"),
        pytest.param(81559, 1, 815, id="one-percent"),
        pytest.param(143771, 50, 71885, id="h200-half"),
    ],
)
def test_memory_limit(memory_mib: int, percent: int, mib: int) -> None:
    gpu = GpuInfo(index=0, uuid="GPU-x", memory_mib=memory_mib)
    limits = Share(core=100, memory=percent)
    assert memory_limit_mib(gpu, limits) == mib
    assert memory_limit_bytes(gpu, limits) == mib * 1024 * 1024
