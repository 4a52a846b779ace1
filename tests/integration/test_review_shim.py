"""The shim writes its status file through a temporary of its own, not through the one the
executor writes the workload's record with next to it (both files share the pod's stem)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

import gpupool.node_executor.processes as processes

pytestmark = pytest.mark.integration

SHIM = Path(processes.__file__).with_name("shim.py")


async def test_the_shim_does_not_write_through_the_records_temporary(tmp_path: Path) -> None:
    records = tmp_path / "workloads"
    records.mkdir()
    record_temporary = records / "default.demo.tmp"  # the record, being written by the executor
    record_temporary.write_bytes(b'{"pod": "being written"}')

    shim = await asyncio.create_subprocess_exec(
        sys.executable,
        "-I",
        "-S",
        str(SHIM),
        str(records / "default.demo.status"),
        "--",
        sys.executable,
        "-c",
        "raise SystemExit(5)",
    )
    async with asyncio.timeout(10):
        assert await shim.wait() == 5

    assert (records / "default.demo.status").read_text().strip() == "5"
    assert record_temporary.read_bytes() == b'{"pod": "being written"}'
