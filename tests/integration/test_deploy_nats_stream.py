"""deploy/base/nats/ensure_stream.py against real nats-servers.

The init container of every service pod runs this script: it must create the
log's stream exactly as the services would, give it the replicas the cluster
wants (3 in production, on a real 3-server JetStream cluster here), scale a
stream that a service already created with one replica, change nothing on a
second run, and give up with a clear message when the cluster cannot place the
replicas.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import nats
import pytest
from nats.js.api import DiscardPolicy, StreamConfig

from gpupool.eventlog import JetStreamEventLog
from gpupool.eventlog.nats_server import ServerOutput, find_nats_server
from gpupool.events.limits import MAX_ENTRY_BYTES

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "base" / "nats" / "ensure_stream.py"
SERVERS = 3
READY_TIMEOUT_S = 20.0
RUN_TIMEOUT_S = 90.0


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class RunningServer:
    """One nats-server process; ``ready`` is set when it says so or exits."""

    def __init__(self, config: Path) -> None:
        self.output = ServerOutput()
        self.ready = threading.Event()
        self.process = subprocess.Popen(
            [str(find_nats_server()), "-c", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.output.add(line)
            if self.output.ready:
                self.ready.set()
        self.ready.set()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.reader.join(timeout=10)
        if self.process.stderr is not None:
            self.process.stderr.close()


@pytest.fixture(scope="module")
def cluster_urls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """A JetStream cluster of 3 nats-servers on 127.0.0.1: the client URLs."""
    root = tmp_path_factory.mktemp("nats-cluster")
    ports = free_ports(2 * SERVERS)
    client_ports, route_ports = ports[:SERVERS], ports[SERVERS:]
    routes = ", ".join(f"nats://127.0.0.1:{port}" for port in route_ports)
    with ExitStack() as stack:
        servers = []
        for index in range(SERVERS):
            config = root / f"n{index}.conf"
            config.write_text(
                f"server_name: n{index}\n"
                f"listen: 127.0.0.1:{client_ports[index]}\n"
                f"jetstream {{ store_dir: {root / f'store-{index}'} }}\n"
                f"cluster {{ name: gpupool-test, listen: 127.0.0.1:{route_ports[index]}, "
                f"routes: [{routes}] }}\n"
            )
            server = RunningServer(config)
            stack.callback(server.stop)
            servers.append(server)
        for server in servers:
            if not server.ready.wait(READY_TIMEOUT_S) or not server.output.ready:
                raise server.output.failure("a nats-server of the cluster did not start")
        yield [f"nats://127.0.0.1:{port}" for port in client_ports]


def unique_names() -> tuple[str, str]:
    token = uuid.uuid4().hex[:10]
    return f"DEPLOY_{token}", f"deploy_{token}.log"


def ensure_stream(
    url: str,
    stream: str,
    prefix: str,
    replicas: int,
    *,
    deadline_s: float = 60.0,
    max_bytes: str = "1GiB",
) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "GPUPOOL_NATS_URL": url,
        "GPUPOOL_STREAM": stream,
        "GPUPOOL_SUBJECT_PREFIX": prefix,
        "GPUPOOL_STREAM_REPLICAS": str(replicas),
        "GPUPOOL_STREAM_DEADLINE_S": str(deadline_s),
        "GPUPOOL_STREAM_MAX_BYTES": max_bytes,
    }
    return subprocess.run(
        [sys.executable, str(SCRIPT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )


async def stream_config(url: str, stream: str) -> tuple[StreamConfig, int, int]:
    """The stream's configuration, its number of peers besides the leader, its messages."""
    nc = await nats.connect(url)
    try:
        info = await nc.jetstream().stream_info(stream)
        peers = len(info.cluster.replicas or []) if info.cluster else 0
        return info.config, peers, info.state.messages
    finally:
        await nc.close()


async def delete_streams(url: str, *streams: str) -> None:
    nc = await nats.connect(url)
    try:
        for stream in streams:
            await nc.jetstream().delete_stream(stream)
    finally:
        await nc.close()


async def as_the_services_create_it(url: str, stream: str, prefix: str) -> StreamConfig:
    log = await JetStreamEventLog.connect(url, stream=stream, subject_prefix=prefix)
    await log.close()
    config, _, _ = await stream_config(url, stream)
    return config


async def test_creates_the_stream_as_the_services_would_with_three_replicas(
    cluster_urls: list[str],
) -> None:
    stream, prefix = unique_names()
    reference, reference_prefix = unique_names()
    try:
        result = ensure_stream(cluster_urls[1], stream, prefix, replicas=3)
        assert result.returncode == 0, result.stderr
        config, peers, _ = await stream_config(cluster_urls[0], stream)
        assert config.num_replicas == 3
        assert peers == 2
        assert config.subjects == [f"{prefix}.>"]
        services = await as_the_services_create_it(cluster_urls[2], reference, reference_prefix)
        assert services.num_replicas == 1
        fields = ("retention", "storage", "discard", "max_msgs", "max_bytes", "max_msg_size")
        for field in (*fields, "max_age"):
            assert getattr(config, field) == getattr(services, field), field
        assert config.duplicate_window == services.duplicate_window
    finally:
        await delete_streams(cluster_urls[0], stream, reference)


async def test_scales_a_stream_a_service_created_and_keeps_its_entries(
    cluster_urls: list[str],
) -> None:
    stream, prefix = unique_names()
    try:
        await as_the_services_create_it(cluster_urls[0], stream, prefix)
        nc = await nats.connect(cluster_urls[0])
        try:
            await nc.jetstream().publish(f"{prefix}.gpu-node-1.PodReady", b"{}", stream=stream)
        finally:
            await nc.close()
        first = ensure_stream(cluster_urls[0], stream, prefix, replicas=3)
        assert first.returncode == 0, first.stderr
        assert "replicas 1 -> 3" in first.stderr
        config, peers, messages = await stream_config(cluster_urls[2], stream)
        assert (config.num_replicas, peers, messages) == (3, 2, 1)
        second = ensure_stream(cluster_urls[2], stream, prefix, replicas=3)
        assert second.returncode == 0, second.stderr
        assert "nothing to do" in second.stderr
        assert await stream_config(cluster_urls[1], stream) == (config, 2, 1)
    finally:
        await delete_streams(cluster_urls[0], stream)


async def test_gives_up_when_the_cluster_cannot_place_the_replicas(
    cluster_urls: list[str],
) -> None:
    stream, prefix = unique_names()
    try:
        result = ensure_stream(cluster_urls[0], stream, prefix, replicas=5, deadline_s=2.0)
        assert result.returncode == 1
        assert "giving up" in result.stderr
        assert "no suitable peers for placement" in result.stderr
        config, _, _ = await stream_config(cluster_urls[0], stream)
        assert config.num_replicas == 1  # as the services left it: usable, not lost
    finally:
        await delete_streams(cluster_urls[0], stream)


def test_one_replica_on_a_single_server(nats_url: str) -> None:
    """The dev overlay: one NATS server, GPUPOOL_STREAM_REPLICAS=1."""
    stream, prefix = unique_names()
    result = ensure_stream(nats_url, stream, prefix, replicas=1)
    assert result.returncode == 0, result.stderr
    assert "nothing to do" in result.stderr  # created with one replica, as asked


async def test_bounds_an_unbounded_stream_it_finds_and_then_changes_nothing(
    nats_url: str,
) -> None:
    """A stream created before the log had bounds gets them (discard: new) on the next deploy."""
    stream, prefix = unique_names()
    nc = await nats.connect(nats_url)
    try:
        await nc.jetstream().add_stream(
            StreamConfig(name=stream, subjects=[f"{prefix}.>"], discard=DiscardPolicy.OLD)
        )
    finally:
        await nc.close()
    try:
        first = ensure_stream(nats_url, stream, prefix, replicas=1, max_bytes="64MiB")
        assert first.returncode == 0, first.stderr
        assert "max_bytes -1 -> 67108864" in first.stderr
        config, _, _ = await stream_config(nats_url, stream)
        assert (config.max_bytes, config.max_msg_size, config.discard) == (
            64 * 1024 * 1024,
            MAX_ENTRY_BYTES,
            DiscardPolicy.NEW,
        )
        second = ensure_stream(nats_url, stream, prefix, replicas=1, max_bytes="64MiB")
        assert "nothing to do" in second.stderr, second.stderr
    finally:
        await delete_streams(nats_url, stream)


def test_rejects_a_replica_count_jetstream_does_not_allow() -> None:
    result = ensure_stream("nats://127.0.0.1:1", "X", "x.log", replicas=7, deadline_s=1.0)
    assert result.returncode == 2
    assert "must be 1..5" in result.stderr
