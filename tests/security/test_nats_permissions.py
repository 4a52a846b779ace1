"""NATS authentication and per-service permissions, on a real nats-server with the generated config.

``gpupool credentials generate`` (:func:`gpupool.eventlog.credentials.write_credentials`)
writes the server's ``authorization`` block, one nkey seed per service and a CA with
a server certificate. The server here runs with the deployed nats.conf (Kubernetes,
dev overlay) and those files where the pods mount them.

What is proved:

* a client without credentials, one with a key the server does not know, and one
  that does not trust the server's CA are refused;
* each service's credential works for everything its code does (create the stream,
  append, append under optimistic concurrency, replay, its durable consumer, acks;
  test_nats_durables.py: no service may touch another's durable);
* each service's credential may publish on its own writer's subjects and on nothing
  else: not another writer's subjects, not another node's executor subjects;
* no credential can purge, delete or restore the stream, delete a message, or (but
  the stream admin's) change the stream's configuration; the stream is intact after;
* the reader (console, ``gpupool log``/``verify``) reads everything and publishes nothing.

A forbidden publish is detected from the server's own answer: nats-server sends
``-ERR 'Permissions Violation for Publish to "<subject>"'`` for each; the tests wait
for those answers (and check the stream did not change).
"""

from __future__ import annotations

import asyncio
import os
import ssl
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import nats
import nats.errors
import nats.js.errors
import pytest
import yaml
from nats.aio.client import Client as NatsClient

from gpupool.core.simulation import Scenario, simulate
from gpupool.eventlog.credentials import (
    CA_CERT,
    NODE_EXECUTOR,
    READER,
    STREAM_ADMIN,
    Generated,
    connect_options,
    new_user_seed,
    write_credentials,
)
from gpupool.eventlog.durables import CLAIMANT, durable_names
from gpupool.eventlog.jetstream import JetStreamEventLog
from gpupool.eventlog.nats_server import nats_server_process
from gpupool.eventlog.reader import ReadOnlyLog
from gpupool.eventlog.subjects import (
    DEFAULT_SUBJECT_PREFIX,
    NODELESS_TOKEN,
    WRITERS,
    node_entry_subject,
    node_token,
)
from gpupool.events import NODELESS, Envelope, encode_envelope, event_node

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
STREAM = "GPUPOOL"
PREFIX = DEFAULT_SUBJECT_PREFIX


def worked_example() -> list[Envelope]:
    scenario = msgspec.convert(
        yaml.safe_load((ROOT / "scenarios" / "worked-example.yaml").read_text()), Scenario
    )
    return simulate(scenario)


ENVELOPES = worked_example()
NODES = sorted({event_node(e.event) for e in ENVELOPES} - {NODELESS})
OTHER_NODE = "gpu-node-other"


def fresh(envelope: Envelope) -> Envelope:
    """The envelope under a new id (the server would take a known id for a duplicate)."""
    return msgspec.structs.replace(envelope, id=str(uuid.uuid4()))


@dataclass
class Deployment:
    url: str
    generated: Generated
    ca: Path

    def seed(self, user: str) -> Path:
        return self.generated.seeds[user]


DEPLOYED_CONFIG = ROOT / "deploy" / "overlays" / "dev" / "nats.conf"
"""The single-server nats.conf of the Kubernetes dev overlay: the base's 3-server one differs
only by its cluster block (test_deploy_manifests checks both are accepted by nats-server)."""


def server_config(directory: Path) -> Path:
    """The deployed nats.conf at ``<root>/etc/nats/``, the generated files where the pod
    mounts the Secret (``<root>/etc/nats-credentials``, ``directory`` itself); the client
    address and store come from the command line, the monitoring port is any free one."""
    root = directory.parent.parent
    text = DEPLOYED_CONFIG.read_text()
    assert 'include "../nats-credentials/nats-auth.conf"' in text
    assert "http: 127.0.0.1:8222" in text
    text = (
        text.replace("/etc/", f"{root}/etc/")
        .replace("$POD_NAME", "gpupool-nats-0")
        .replace("/var/run/nats/", f"{root}/")
        .replace("http: 127.0.0.1:8222", "http: 127.0.0.1:-1")
        .replace("store_dir: /data", "")  # the command line's -sd names the temporary store
    )
    config = root / "etc" / "nats" / "nats.conf"
    config.parent.mkdir(parents=True)
    config.write_text(text)
    return config


DEPLOYED_SETTINGS = ROOT / "deploy" / "overlays" / "dev" / "kustomization.yaml"


def deployed_setting(name: str) -> str:
    """A setting the dev overlay gives every service (its gpupool-settings literals)."""
    for line in DEPLOYED_SETTINGS.read_text().splitlines():
        literal = line.strip().removeprefix("- ")
        if literal.startswith(f"{name}="):
            return literal.split("=", 1)[1]
    raise AssertionError(f"{DEPLOYED_SETTINGS} sets no {name}")


@pytest.fixture(scope="module", autouse=True)
def deployed_stream_bounds() -> Iterator[None]:
    """The stream's bound as deployed: it must fit the overlay's file store, which the
    library's default (for a server of its own) does not."""
    name = "GPUPOOL_STREAM_MAX_BYTES"
    before = os.environ.get(name)
    os.environ[name] = deployed_setting(name)
    yield
    if before is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = before


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    directory = tmp_path_factory.mktemp("deployed") / "etc" / "nats-credentials"
    generated = write_credentials(
        directory, nodes=[*NODES, OTHER_NODE], tls_names=("localhost", "127.0.0.1")
    )
    store = tmp_path_factory.mktemp("nats-secure-store")
    with nats_server_process(store, config=server_config(directory)) as url:
        yield Deployment(url=url, generated=generated, ca=directory / CA_CERT)


@dataclass
class Violations:
    seen: list[str] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def error(self, exc: Exception) -> None:
        self.seen.append(str(exc))
        self.changed.set()

    async def wait_for(self, subjects: list[str], timeout: float = 10.0) -> list[str]:
        """Wait until the server has refused each of ``subjects``; those it did not refuse."""
        try:
            async with asyncio.timeout(timeout):
                while not all(self.forbidden(s) for s in subjects):
                    self.changed.clear()
                    await self.changed.wait()
        except TimeoutError:
            pass
        return [s for s in subjects if not self.forbidden(s)]

    def forbidden(self, subject: str) -> bool:
        # nats-py reports the server's -ERR in lower case
        wanted = f'permissions violation for publish to "{subject}"'.lower()
        return any(wanted in text.lower() for text in self.seen)


async def client(deployment: Deployment, user: str | None, violations: Violations) -> NatsClient:
    credentials = deployment.seed(user) if user is not None else None
    return await nats.connect(
        deployment.url,
        error_cb=violations.error,
        allow_reconnect=False,
        connect_timeout=5,
        **connect_options(credentials, deployment.ca),
    )


@pytest.fixture
async def stream_exists(deployment: Deployment) -> None:
    """The stream, created (idempotently) as the deployment's ensure-stream step does."""
    log = await JetStreamEventLog.connect(
        deployment.url,
        credentials=deployment.seed(STREAM_ADMIN),
        tls_ca=deployment.ca,
        name="ensure-stream",
    )
    await log.close()


# ------------------------------------------------------------------ authentication


@pytest.mark.parametrize("who", ["anonymous", "unknown-key"])
async def test_a_client_without_a_known_credential_is_refused(
    deployment: Deployment, who: str, tmp_path: Path
) -> None:
    options = connect_options(None, deployment.ca)
    if who == "unknown-key":
        seed = tmp_path / "stranger.nk"
        seed.write_bytes(new_user_seed())
        options = connect_options(seed, deployment.ca)
    errors: list[Exception] = []

    async def error(exc: Exception) -> None:
        errors.append(exc)

    with pytest.raises((nats.errors.Error, OSError)):
        await nats.connect(
            deployment.url,
            error_cb=error,
            allow_reconnect=False,
            max_reconnect_attempts=0,
            connect_timeout=5,
            **options,
        )
    assert any("authorization violation" in str(e).lower() for e in errors), errors


async def test_a_client_that_does_not_trust_the_servers_ca_is_refused(
    deployment: Deployment,
) -> None:
    # The default context trusts the system's CAs, not the deployment's own.
    with pytest.raises((nats.errors.Error, OSError, ssl.SSLError)):
        await nats.connect(
            deployment.url,
            allow_reconnect=False,
            max_reconnect_attempts=0,
            connect_timeout=5,
            nkeys_seed=str(deployment.seed("policy")),
            tls=ssl.create_default_context(),
        )


async def test_a_client_that_speaks_plain_text_is_refused(deployment: Deployment) -> None:
    host, port = deployment.url.removeprefix("nats://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        async with asyncio.timeout(10):
            info = await reader.readline()
            assert b'"tls_required":true' in info
            writer.write(b'CONNECT {"verbose":false}\r\nPING\r\n')
            await writer.drain()
            answer = await reader.read()  # until the server closes the connection
    finally:
        writer.close()
    assert b"PONG" not in answer


# ------------------------------------------------------------------ what each service needs


def writer_and_user() -> list[tuple[str, str, str]]:
    """(writer token, user name, the node it appends for) of every writing service."""
    node = NODES[0]
    rows = [(w, w, node) for w in WRITERS if w != NODE_EXECUTOR]
    rows.append((NODE_EXECUTOR, f"{NODE_EXECUTOR}-{node_token(node)}", node))
    return rows


@pytest.mark.parametrize(("writer", "user", "node"), writer_and_user())
async def test_each_services_credential_does_everything_the_service_does(
    deployment: Deployment, writer: str, user: str, node: str
) -> None:
    own = [fresh(e) for e in ENVELOPES if event_node(e.event) == node][:2]
    log = await JetStreamEventLog.connect(
        deployment.url,
        credentials=deployment.seed(user),
        tls_ca=deployment.ca,
        name=user,
        writer=writer,
        claimant="replica-1",
        consumer_base=user,  # as run_service connects with a credential
    )
    try:
        first = await log.append(own[0])
        # optimistic concurrency (a get of the node's last message) and a stale expectation
        second = await log.append(own[1], expected_node_seq=first)
        assert second > first
        replayed = [entry.seq async for entry in log.replay(node=node, from_seq=first)]
        assert replayed[:2] == [first, second]
        # its own durable: one of the user's slots, claimed for this replica
        async with log.subscribe(durable=user, node=node, from_seq=first) as subscription:
            async with asyncio.timeout(20):
                delivery = await anext(subscription)
                await delivery.ack()
            assert subscription.durable in durable_names(user)
        assert await log.last_seq() >= second
    finally:
        await log.close()


async def test_the_reader_reads_the_log_and_can_publish_nothing(
    deployment: Deployment, stream_exists: None
) -> None:
    del stream_exists
    writer = await JetStreamEventLog.connect(
        deployment.url, credentials=deployment.seed("policy"), tls_ca=deployment.ca, writer="policy"
    )
    try:
        await writer.append(fresh(ENVELOPES[0]))
    finally:
        await writer.close()
    reader = await ReadOnlyLog.connect(
        deployment.url, credentials=deployment.seed(READER), tls_ca=deployment.ca
    )
    try:
        last = await reader.last_seq()
        assert last > 0
        seqs = [entry.seq async for entry in reader.entries(until_seq=last)]
        assert seqs and seqs[-1] == last
    finally:
        await reader.close()
    violations = Violations()
    nc = await client(deployment, READER, violations)
    try:
        subjects = [node_entry_subject(NODES[0], writer=w, prefix=PREFIX) for w in WRITERS]
        for subject in subjects:
            await nc.publish(subject, encode_envelope(ENVELOPES[0]))
        assert await violations.wait_for(subjects) == [], violations.seen
    finally:
        await nc.close()


# ------------------------------------------------------------------ exactly its own subjects


def allowed_and_forbidden(user: str) -> tuple[list[str], list[str]]:
    """The log subjects ``user`` may publish on, and those it may not (of a sample of nodes)."""
    nodes = [NODES[0], OTHER_NODE, NODELESS]
    every = {
        (writer, node): node_entry_subject(node, writer=writer, prefix=PREFIX)
        for writer in WRITERS
        for node in nodes
    }
    every[("gpupool", NODES[0])] = node_entry_subject(NODES[0], prefix=PREFIX)
    if user.startswith(f"{NODE_EXECUTOR}-"):
        mine = {(NODE_EXECUTOR, NODES[0])}
    else:
        mine = {(user, node) for node in nodes}
    allowed = [subject for key, subject in every.items() if key in mine]
    forbidden = [subject for key, subject in every.items() if key not in mine]
    return allowed, forbidden


@pytest.mark.parametrize("user", [u for _, u, _ in writer_and_user()])
async def test_each_services_credential_publishes_only_its_own_writers_subjects(
    deployment: Deployment, stream_exists: None, user: str
) -> None:
    del stream_exists
    allowed, forbidden = allowed_and_forbidden(user)
    assert allowed and forbidden
    violations = Violations()
    nc = await client(deployment, user, violations)
    try:
        js = nc.jetstream(timeout=5)
        before = (await js.stream_info(STREAM)).state.messages
        for subject in forbidden:
            await nc.publish(subject, encode_envelope(ENVELOPES[0]))
        for subject in allowed:
            ack = await js.publish(subject, encode_envelope(ENVELOPES[0]))
            assert ack.stream == STREAM
        assert await violations.wait_for(forbidden) == [], violations.seen
        assert [s for s in allowed if violations.forbidden(s)] == []
        after = (await js.stream_info(STREAM)).state.messages
        assert after - before == len(allowed)  # none of the forbidden publishes landed
    finally:
        await nc.close()


def test_the_executor_of_one_node_may_not_append_for_another_node() -> None:
    allowed, forbidden = allowed_and_forbidden(f"{NODE_EXECUTOR}-{node_token(NODES[0])}")
    assert allowed == [node_entry_subject(NODES[0], writer=NODE_EXECUTOR, prefix=PREFIX)]
    assert node_entry_subject(OTHER_NODE, writer=NODE_EXECUTOR, prefix=PREFIX) in forbidden
    assert f"{PREFIX}.{NODELESS_TOKEN}.{NODE_EXECUTOR}" in forbidden


# ------------------------------------------------------------------ the stream is safe


STREAM_CHANGES = [
    f"$JS.API.STREAM.PURGE.{STREAM}",
    f"$JS.API.STREAM.DELETE.{STREAM}",
    f"$JS.API.STREAM.MSG.DELETE.{STREAM}",
    f"$JS.API.STREAM.RESTORE.{STREAM}",
    f"$JS.API.STREAM.SNAPSHOT.{STREAM}",
]


@pytest.mark.parametrize(
    "user",
    [u for _, u, _ in writer_and_user()] + [READER, STREAM_ADMIN],
)
async def test_no_credential_can_purge_delete_or_edit_the_stream(
    deployment: Deployment, stream_exists: None, user: str
) -> None:
    del stream_exists
    violations = Violations()
    nc = await client(deployment, user, violations)
    try:
        js = nc.jetstream(timeout=5)
        info = await js.stream_info(STREAM)
        changes = list(STREAM_CHANGES)
        if user != STREAM_ADMIN:
            changes.append(f"$JS.API.STREAM.UPDATE.{STREAM}")
        for subject in changes:
            await nc.publish(subject, b'{"seq": 1}', reply=nc.new_inbox())
        assert await violations.wait_for(changes) == [], violations.seen
        with pytest.raises(nats.errors.TimeoutError):  # the library's own purge: no answer
            await nc.jetstream(timeout=1).purge_stream(STREAM)
        after = await js.stream_info(STREAM)
        assert after.state.messages >= info.state.messages
        assert after.state.first_seq == info.state.first_seq
    finally:
        await nc.close()


# ------------------------------------------------------------------ a real service process


@pytest.mark.parametrize("service", ["admission-queue", "preemption"])
async def test_a_service_process_runs_with_its_credential_from_the_environment(
    deployment: Deployment, service: str, tmp_path: Path
) -> None:
    """The deployments' way: GPUPOOL_NATS_CREDENTIALS / GPUPOOL_NATS_CA in the environment.
    The service connects over TLS, rebuilds, creates its durable, consumes, and stops cleanly."""
    env = {
        **os.environ,
        "GPUPOOL_NATS_URL": deployment.url,
        "GPUPOOL_NATS_CREDENTIALS": str(deployment.seed(service)),
        "GPUPOOL_NATS_CA": str(deployment.ca),
        "GPUPOOL_HTTP_PORT": "0",
        "GPUPOOL_INSTANCE": "security-test",
    }
    module = f"gpupool.{service.replace('-', '_')}"
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        module,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        cwd=tmp_path,
    )
    assert process.stderr is not None
    seen: list[str] = []
    try:
        async with asyncio.timeout(60):
            async for raw in process.stderr:
                seen.append(raw.decode(errors="replace"))
                if "rebuilt from" in seen[-1]:
                    break
        assert any("rebuilt from" in line for line in seen), "".join(seen)
        # its durable exists: the service claimed one of its slots with its own credential
        violations = Violations()
        nc = await client(deployment, service, violations)
        try:
            claimed: list[str] = []
            async with asyncio.timeout(20):
                while not claimed:
                    for name in durable_names(service):
                        try:
                            info = await nc.jetstream(timeout=2).consumer_info(STREAM, name)
                        except nats.js.errors.NotFoundError:
                            continue
                        if (info.config.metadata or {}).get(CLAIMANT) == "security-test":
                            claimed.append(name)
                    if not claimed:
                        await asyncio.sleep(0.1)  # created right after the rebuild: poll the server
            assert len(claimed) == 1, claimed
        finally:
            await nc.close()
    finally:
        if process.returncode is None:
            process.terminate()
        async with asyncio.timeout(30):
            rest = await process.stderr.read()
            code = await process.wait()
    assert code == 0, "".join(seen) + rest.decode(errors="replace")
    assert "permissions violation" not in ("".join(seen) + rest.decode()).lower()


async def test_the_ensure_stream_step_runs_with_the_stream_admin_credential(
    deployment: Deployment,
) -> None:
    env = {
        **os.environ,
        "GPUPOOL_NATS_URL": deployment.url,
        "GPUPOOL_NATS_CREDENTIALS": str(deployment.seed(STREAM_ADMIN)),
        "GPUPOOL_NATS_CA": str(deployment.ca),
        "GPUPOOL_STREAM_REPLICAS": "1",
        "GPUPOOL_STREAM_DEADLINE_S": "20",
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(ROOT / "deploy" / "base" / "nats" / "ensure_stream.py"),
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(60):
        _, stderr = await process.communicate()
    said = stderr.decode(errors="replace")
    assert process.returncode == 0, said
    assert "stream GPUPOOL has 1 replica(s) and its bounds; nothing to do" in said
