"""A failing executor leaves its workloads running under their shims, on every Python.

docs/node-executor.md: a failure of the service (an exception through its stack, such as a
NATS timeout) ends nothing; the commands keep running under their shims for the next
executor to adopt. The service here is a real process running ``serve`` (so ``asyncio.run``
closes its loop and the interpreter shuts down with the workload still running), whose main
starts a workload through ``ProcessSupervisor.start`` with the real shim and then fails.

The command runs until its stdin (a pipe the test holds) reaches EOF, then exits 3. The shim
writes that status only if it was alive to see its command end: a shim killed when the
executor went leaves no status, and the successor reads 137.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import msgspec
import pytest

from gpupool.node_executor.processes import (
    ProcessSupervisor,
    WorkloadRecord,
    leader_exited,
    process_start_ticks,
)

pytestmark = pytest.mark.integration

SERVICE_EXIT_TIMEOUT = 30.0
WORKLOAD_EXIT_TIMEOUT = 10.0

FAILING_SERVICE = """
import os, sys
from pathlib import Path

from gpupool.events import PodRef
from gpupool.node_executor.processes import ProcessSupervisor
from gpupool.runtime.service import serve

records, stdin_fd = Path(sys.argv[1]), int(sys.argv[2])


class Executor:
    workload = None  # kept, as the executor keeps its sessions' workloads


executor = Executor()


async def main(stop):
    devnull = os.open(os.devnull, os.O_WRONLY)
    executor.workload = await ProcessSupervisor(records_dir=records).start(
        PodRef(namespace="default", name="survivor"),
        [sys.executable, "-c", "import sys; sys.stdin.read(); raise SystemExit(3)"],
        {"PATH": os.environ["PATH"]},
        str(records),
        (stdin_fd, devnull, devnull),
    )
    raise TimeoutError("nats: timeout (the service fails)")


serve(main)
"""


def shim_alive(pid: int) -> bool:
    """Still running (not a zombie, not gone): its pidfd is not readable."""
    return pid > 0 and not leader_exited(pid)


async def test_a_workload_keeps_running_under_its_shim_when_the_executor_fails(
    tmp_path: Path,
) -> None:
    records = tmp_path / "workloads"
    records.mkdir()
    read_fd, write_fd = os.pipe()
    shim_pid = 0
    try:
        service = await asyncio.create_subprocess_exec(
            *(sys.executable, "-c", FAILING_SERVICE, str(records), str(read_fd)),
            pass_fds=(read_fd,),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        os.close(read_fd)
        read_fd = -1
        async with asyncio.timeout(SERVICE_EXIT_TIMEOUT):
            _, stderr = await service.communicate()
        assert service.returncode == 1, stderr.decode()
        assert b"TimeoutError: nats: timeout" in stderr

        [record_path] = records.glob("*.json")
        record = msgspec.json.decode(record_path.read_bytes(), type=WorkloadRecord)
        shim_pid = record.pid
        assert shim_pid > 0, "recorded as started"
        assert shim_alive(shim_pid), "the shim died with the executor"
        assert process_start_ticks(shim_pid) == record.start_ticks

        # the next executor adopts it and reads its end from the shim's status file
        successor = ProcessSupervisor(records_dir=records)
        [adopted] = successor.adopt()
        assert adopted.pid == shim_pid
        os.close(write_fd)  # the command reads EOF and exits 3
        write_fd = -1
        async with asyncio.timeout(WORKLOAD_EXIT_TIMEOUT):
            assert await adopted.wait_exit() == 3
    finally:
        for fd in (read_fd, write_fd):
            if fd >= 0:
                os.close(fd)
        if shim_alive(shim_pid):
            os.killpg(shim_pid, signal.SIGKILL)
