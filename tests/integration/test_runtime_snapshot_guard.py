"""A snapshot that covers more of the log than the log has (the stream was recreated) is set
aside: the service rebuilds from the log it really has."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from gpupool.admission_queue.service import AdmissionQueue
from gpupool.cli.local_stack import http_get
from gpupool.eventlog.nats_server import run_nats_server
from gpupool.runtime.projection import metrics_projection
from gpupool.runtime.service import ServiceOptions, run_service
from gpupool.runtime.snapshot_store import FileSnapshotStore, save_projection


async def test_a_snapshot_from_a_longer_log_is_set_aside(tmp_path: Path) -> None:
    stale = metrics_projection()
    stale.last_seq = 1000  # as if folded from a stream that no longer exists
    await save_projection(
        FileSnapshotStore(tmp_path / "snapshots" / "admission-queue-t.snapshot"), stale
    )
    async with run_nats_server(tmp_path / "nats") as url:
        options = ServiceOptions(
            nats_url=url,
            http_host="127.0.0.1",
            http_port=0,
            stream="GPUPOOL",
            instance="t",
            snapshot_dir=tmp_path / "snapshots",
        )
        stop = asyncio.Event()
        listening: asyncio.Queue[int] = asyncio.Queue()
        rebuilt = asyncio.Event()

        class RebuiltHandler(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if "rebuilt from" in record.getMessage():
                    rebuilt.set()

        handler = RebuiltHandler()
        logging.getLogger("gpupool.runtime.service").addHandler(handler)
        logging.getLogger("gpupool.runtime.service").setLevel(logging.INFO)

        async def on_listening(port: int) -> None:
            await listening.put(port)

        service = asyncio.create_task(
            run_service(AdmissionQueue(), options, stop, on_listening=on_listening)
        )
        try:
            async with asyncio.timeout(30):
                port = await listening.get()
                await rebuilt.wait()  # the service says so once it has folded the log
            _, metrics = await http_get(port, "/metrics")
        finally:
            logging.getLogger("gpupool.runtime.service").removeHandler(handler)
            stop.set()
            await service
    assert 'gpupool_service_applied_sequence{service="admission-queue"} 0.0' in metrics.decode()
