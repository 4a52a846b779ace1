"""Fresh streams for the integration tests that open their own logs (beside the
``jetstream_log`` fixture): imported by name, as kube_harness is, since a conftest
cannot be (tests/unit/test_tests_import_no_conftest.py)."""

from __future__ import annotations

import uuid

import nats


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
