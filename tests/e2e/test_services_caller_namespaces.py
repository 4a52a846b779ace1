"""With --run-in caller (the Kubernetes setting), the command runs inside the caller's
namespaces: here the caller lives in a mount namespace of its own (unshare, as a container
would) with a file nobody else can see, and the command the executor starts reads it."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from pathlib import Path

import pytest
from stack_harness import running_stack

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = (ROOT / "scenarios" / "worked-example.yaml").read_text()
NODE = "cn-wulanchabu-c.cr-xxx"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and util-linux unshare to make a caller with its own mount namespace",
)


async def run_from_own_mount_namespace(socket: Path, private: Path) -> tuple[int, str]:
    """`gpupool run` from a process with a private tmpfs at ``private`` (holding 'secret')."""
    script = (
        f"mkdir -p {private} && mount -t tmpfs gpupool-test {private} && "
        f"echo only-in-the-callers-namespace > {private}/secret && "
        f"exec {sys.executable} -m gpupool.cli.main run --socket {socket} --pod pod-a -- "
        f"cat {private}/secret"
    )
    process = await asyncio.create_subprocess_exec(
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "--",
        "sh",
        "-c",
        script,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    async with asyncio.timeout(60):
        output, _ = await process.communicate()
    assert process.returncode is not None
    return process.returncode, output.decode()


async def test_the_command_runs_in_the_callers_mount_namespace(tmp_path: Path) -> None:
    private = tmp_path / "pod-filesystem"
    async with running_stack(tmp_path, CLUSTER, NODE, gpus=2, run_in="caller") as stack:
        code, output = await run_from_own_mount_namespace(stack.socket_path, private)
    assert code == 0, output
    assert "only-in-the-callers-namespace" in output
    assert not (private / "secret").exists()  # the executor's namespace never had it


async def test_without_it_the_command_does_not_see_the_callers_files(tmp_path: Path) -> None:
    private = tmp_path / "pod-filesystem"
    async with running_stack(tmp_path, CLUSTER, NODE, gpus=2, run_in="executor") as stack:
        code, output = await run_from_own_mount_namespace(stack.socket_path, private)
    assert code == 1, output  # cat: No such file or directory, released as failed
    assert "only-in-the-callers-namespace" not in output
