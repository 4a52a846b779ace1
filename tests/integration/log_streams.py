"""Fresh streams for the integration tests that open their own logs (beside the
``jetstream_log`` fixture): imported by name, as kube_harness is, since a conftest
cannot be (tests/unit/test_tests_import_no_conftest.py)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import nats

from gpupool.eventlog import JetStreamEventLog


def unique_stream() -> tuple[str, str]:
    """A fresh stream name and the subject prefix it owns."""
    token = uuid.uuid4().hex[:12]
    return f"TEST_{token}", f"test_{token}.log"


async def delete_stream(nats_url: str, stream: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        await nc.jetstream().delete_stream(stream)
    finally:
        await nc.close()


async def acked_up_to(log: JetStreamEventLog, durable: str, seq: int, *, within_s: float) -> Any:
    """The durable's info once the server's ack floor reached ``seq``. Acks are
    fire-and-forget and the server tells nobody when it has folded them, so its state is
    asked again (every 50 ms, within ``within_s``) until it holds."""
    async with asyncio.timeout(within_s):
        while True:
            info = await log._consumer_info(durable)
            if info.ack_floor is not None and info.ack_floor.stream_seq == seq:
                return info
            await asyncio.sleep(0.05)
