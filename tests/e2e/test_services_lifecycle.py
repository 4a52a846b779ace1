"""Service lifecycle: the node-executor refuses to start without GPUs unless asked to
simulate them; SIGTERM drains a service (exit 0); `gpupool up` brings the stack up,
says where the metrics are and that the GPUs are simulated, and stops on Ctrl-C."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

from stack_harness import of_type, running_stack, start_workload, wait_for_log

from gpupool.cli.local_stack import http_get
from gpupool.events import MessageRejected, PodRejected

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = (ROOT / "scenarios" / "worked-example.yaml").read_text()
NODE = "cn-wulanchabu-c.cr-xxx"


async def test_node_executor_refuses_to_start_without_nvml(tmp_path: Path) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gpupool.node_executor",
        "--node-name",
        "n1",
        "--nats",
        "nats://127.0.0.1:1",
        "--socket",
        str(tmp_path / "s.sock"),
        "--state-dir",
        str(tmp_path / "state"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await process.communicate()
    assert process.returncode == 3
    text = output.decode()
    assert "NVML is unavailable" in text
    assert "--simulate-gpus" in text


async def test_sigterm_drains_each_service(tmp_path: Path) -> None:
    async with running_stack(tmp_path, CLUSTER, NODE, gpus=2) as stack:
        for name in ("node-executor", "preemption", "admission-queue", "policy"):
            service = stack.services[name]
            assert service.process is not None
            service.process.send_signal(signal.SIGTERM)
            async with asyncio.timeout(30):
                code = await service.process.wait()
            assert code == 0, f"{name} exited {code} on SIGTERM:\n{service.log_tail()}"
            assert f"{name}: stopped" in service.log_path.read_text()


async def test_gpupool_up_runs_the_stack_until_interrupted(tmp_path: Path) -> None:
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER)
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gpupool.cli.main",
        "up",
        "--cluster",
        str(cluster),
        "--node-name",
        NODE,
        "--simulate-gpus",
        "2",
        "--any-ports",
        "--state-dir",
        str(tmp_path / "state"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert process.stdout is not None
    lines: list[str] = []
    async with asyncio.timeout(60):
        while not any(line.startswith("Ctrl-C") for line in lines):
            raw = await process.stdout.readline()
            assert raw, f"gpupool up ended early: {lines}"
            lines.append(raw.decode().rstrip())
    text = "\n".join(lines)
    assert "2 SIMULATED GPUs" in text
    metrics_lines = [line for line in lines if "/metrics" in line]
    assert len(metrics_lines) == 4
    port = int(metrics_lines[1].split("http://127.0.0.1:")[1].split("/")[0])
    status, _ = await http_get(port, "/readyz")
    assert status == 200
    process.send_signal(signal.SIGINT)
    async with asyncio.timeout(60):
        await process.communicate()
    assert process.returncode == 0


async def test_kernel_identity_refuses_a_caller_outside_any_pod(tmp_path: Path) -> None:
    """In Kubernetes mode the executor believes the kernel (cgroup → pod UID), not the request:
    this test process is in no pod, so it may not act for pod-a."""
    async with running_stack(tmp_path, CLUSTER, NODE, gpus=2, identity="kernel") as stack:
        workload = await start_workload(stack, "pod-a")
        assert await workload.exit_code() == 2
        assert any("NotInAPod" in line for line in workload.lines), workload.lines
        # the refusal is an event too
        log = await wait_for_log(stack, lambda log: bool(of_type(log, PodRejected, "pod-a")))
        assert of_type(log, PodRejected, "pod-a")[0].event.reason == "NotInAPod"


async def test_garbage_on_the_workload_socket_is_refused_and_recorded(tmp_path: Path) -> None:
    async with running_stack(tmp_path, CLUSTER, NODE, gpus=2) as stack:
        reader, writer = await asyncio.open_unix_connection(str(stack.socket_path))
        writer.write(b'{"type": "RunRequest", "pod": 42}\n')  # no fds, wrong fields
        await writer.drain()
        answer = await reader.readline()
        writer.close()
        assert b'"Rejected"' in answer and b"bad-request" in answer
        log = await wait_for_log(stack, lambda log: bool(of_type(log, MessageRejected)))
        rejected = of_type(log, MessageRejected)[0].event
        assert rejected.subject == f"socket:{stack.socket_path}"
        assert rejected.reason.startswith("bad-request: ")
        assert '"pod": 42' in rejected.payload
        assert stack.services["node-executor"].running
