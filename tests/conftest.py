"""Fixtures shared by every test directory.

Event log: one real nats-server (JetStream, temp store, random port) per test
session; each test gets its own stream with its own subject prefix, so tests
never see each other's entries.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest

from gpupool.eventlog import InMemoryEventLog, JetStreamEventLog
from gpupool.eventlog.nats_server import nats_server_process


@pytest.fixture(scope="session")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A nats-server with JetStream for the whole session: its nats:// URL."""
    store_dir: Path = tmp_path_factory.mktemp("nats-store")
    with nats_server_process(store_dir) as url:
        yield url


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


@pytest.fixture
async def jetstream_log(nats_url: str) -> AsyncIterator[JetStreamEventLog]:
    """A JetStreamEventLog on a stream of its own, deleted after the test."""
    stream, prefix = unique_stream()
    log = await JetStreamEventLog.connect(nats_url, stream=stream, subject_prefix=prefix)
    try:
        yield log
    finally:
        await log.close()
        await delete_stream(nats_url, stream)


@pytest.fixture
async def memory_log() -> AsyncIterator[InMemoryEventLog]:
    log = InMemoryEventLog()
    try:
        yield log
    finally:
        await log.close()
