"""The console reads the log with a NATS user that may only read it.

A real nats-server with two users: ``writer`` (everything) and ``reader``, with the
permissions ``gpupool credentials generate`` gives its reader (stream info, message
get, its own replay consumers, its inbox). The writer
appends the worked example; the console's feed, connected as ``reader``, receives
every entry, including one appended while it follows; the same user is refused
when it tries to append to the log.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
import nats
import pytest
import yaml
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import APIError

from gpupool.console.feed import NatsFeed
from gpupool.core.simulation import Scenario, simulate
from gpupool.eventlog.credentials import reader_user
from gpupool.eventlog.jetstream import JetStreamEventLog
from gpupool.eventlog.nats_server import READY_LINE, find_nats_server
from gpupool.events import Envelope

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
READER = reader_user().permissions
"""The reader's permissions, as ``gpupool credentials generate`` grants them (docs/security.md)."""
READER_PERMISSIONS = (
    f"publish: {{ allow: {json.dumps(list(READER.publish))}, "
    f"deny: {json.dumps(list(READER.deny_publish))} }}\n"
    f"    subscribe: {{ allow: {json.dumps(list(READER.subscribe))} }}"
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@asynccontextmanager
async def server_with_users(tmp_path: Path) -> AsyncIterator[int]:
    port = free_port()
    config = tmp_path / "nats.conf"
    config.write_text(
        f"""
listen: "127.0.0.1:{port}"
jetstream {{ store_dir: "{tmp_path / "store"}" }}
authorization {{
  users = [
    {{ user: writer, password: writer-secret }}
    {{ user: reader, password: reader-secret, permissions: {{ {READER_PERMISSIONS} }} }}
  ]
}}
"""
    )
    process = await asyncio.create_subprocess_exec(
        str(find_nats_server()),
        "-c",
        str(config),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stderr is not None
    try:
        async with asyncio.timeout(30):
            while READY_LINE not in (await process.stderr.readline()).decode():
                pass
        yield port
    finally:
        process.terminate()
        await process.wait()


def worked_example() -> list[Envelope]:
    scenario = msgspec.convert(
        yaml.safe_load((ROOT / "scenarios" / "worked-example.yaml").read_text()), Scenario
    )
    return simulate(scenario)


async def test_the_console_follows_the_log_as_a_read_only_user(tmp_path: Path) -> None:
    log = worked_example()
    async with server_with_users(tmp_path) as port:
        writer = await JetStreamEventLog.connect(f"nats://writer:writer-secret@127.0.0.1:{port}")
        feed = NatsFeed(f"nats://reader:reader-secret@127.0.0.1:{port}")
        try:
            for envelope in log[:-1]:
                await writer.append(envelope)
            await feed.start()
            async with asyncio.timeout(20):
                version = 0
                while len(feed.entries) < len(log) - 1:
                    version = await feed.wait_after(version)
                await writer.append(log[-1])  # appended while the console follows
                while len(feed.entries) < len(log):
                    version = await feed.wait_after(version)
            assert [entry.seq for entry in feed.entries] == list(range(1, len(log) + 1))

            reader = await nats.connect(f"nats://reader:reader-secret@127.0.0.1:{port}")
            try:
                with pytest.raises((APIError, NoRespondersError, NatsTimeout)):
                    await reader.jetstream(timeout=2).publish(
                        "gpupool.log.cn-wulanchabu-c_cr-xxx.PodRemoved", b"{}"
                    )
            finally:
                await reader.close()
            assert await writer.last_seq() == len(log)  # the reader's publish did not land
        finally:
            await feed.close()
            await writer.close()
    assert len(log) == 15
