"""A workload that ended while the executor was down is adopted, against real processes.

Its shim is gone and reaped, so its record's pid no longer names it: it is adopted with
pid -1, and waiting for it or ending it must read the shim's status file, not fail.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpupool.events import PodRef
from gpupool.node_executor.processes import ProcessSupervisor

pytestmark = pytest.mark.integration

POD = PodRef(namespace="default", name="demo")


@pytest.fixture
def devnull() -> Iterator[int]:
    fd = os.open(os.devnull, os.O_RDWR)
    yield fd
    os.close(fd)


async def ended_workload_records(tmp_path: Path, devnull: int, code: str) -> Path:
    """Run ``code`` under the shim to its end, as an executor that then crashed would have."""
    records = tmp_path / "workloads"
    first = ProcessSupervisor(records_dir=records)
    workload = await first.start(
        POD,
        [sys.executable, "-c", code],
        {"PATH": os.environ["PATH"]},
        str(tmp_path),
        (devnull, devnull, devnull),
    )
    async with asyncio.timeout(10):
        await workload.wait_exit()  # reaped: its pid names nothing any more
    return records


@pytest.mark.parametrize(
    ("code", "status_kept", "expected"),
    [
        pytest.param("raise SystemExit(3)", True, 3, id="status-written"),
        pytest.param("raise SystemExit(3)", False, 137, id="shim-killed-no-status"),
    ],
)
async def test_a_workload_that_ended_while_the_executor_was_down_is_adopted(
    tmp_path: Path, devnull: int, code: str, status_kept: bool, expected: int
) -> None:
    records = await ended_workload_records(tmp_path, devnull, code)
    if not status_kept:
        for status in records.glob("*.status"):
            status.unlink()

    successor = ProcessSupervisor(records_dir=records)
    [adopted] = successor.adopt()
    assert adopted.pod == POD
    async with asyncio.timeout(10):
        assert await adopted.wait_exit() == expected
        termination = await successor.terminate(adopted, 1.0)
    assert termination.ended_by == "exited"
    assert termination.exit_code == expected
