"""The operator's credential, on a real nats-server with the deployed configuration: it archives
and purges the stream (`gpupool log archive` / `purge`), while no service credential can purge
and the operator can append nothing nor delete the stream. Its seed is in no Secret a service
mounts. (The generated config and the server are those of test_nats_permissions.)"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_nats_permissions import (
    ENVELOPES,
    NODES,
    Deployment,
    Violations,
    client,
    fresh,
    server_config,
)

from gpupool.cli.main import main
from gpupool.eventlog.archive import StreamOperator
from gpupool.eventlog.credentials import (
    CA_CERT,
    KUBERNETES_SECRETS,
    NODE_EXECUTOR,
    OPERATOR,
    READER,
    STREAM_ADMIN,
    write_credentials,
)
from gpupool.eventlog.jetstream import JetStreamEventLog
from gpupool.eventlog.nats_server import nats_server_process
from gpupool.eventlog.subjects import WRITERS, node_entry_subject, node_token
from gpupool.events import encode_envelope

pytestmark = pytest.mark.integration

STREAM = "GPUPOOL"
SERVICE_USERS = [w for w in WRITERS if w != NODE_EXECUTOR] + [
    f"{NODE_EXECUTOR}-{node_token(NODES[0])}",
    READER,
    STREAM_ADMIN,
]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    directory = tmp_path_factory.mktemp("deployed") / "etc" / "nats-credentials"
    generated = write_credentials(directory, nodes=NODES, tls_names=("localhost", "127.0.0.1"))
    store = tmp_path_factory.mktemp("nats-operator-store")
    with nats_server_process(store, config=server_config(directory)) as url:
        yield Deployment(url=url, generated=generated, ca=directory / CA_CERT)


async def appended(deployment: Deployment, count: int) -> int:
    log = await JetStreamEventLog.connect(
        deployment.url, credentials=deployment.seed("policy"), tls_ca=deployment.ca, writer="policy"
    )
    try:
        for envelope in ENVELOPES[:count]:
            last = await log.append(fresh(envelope))
        return last
    finally:
        await log.close()


async def sequences(deployment: Deployment) -> tuple[int, int]:
    operator = await StreamOperator.connect(
        deployment.url, credentials=deployment.seed(OPERATOR), tls_ca=deployment.ca
    )
    try:
        return await operator.sequences()
    finally:
        await operator.close()


async def test_the_operator_archives_and_purges_and_no_service_credential_can_purge(
    deployment: Deployment, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    last = await appended(deployment, 6)
    credentials = [
        "--nats",
        deployment.url,
        "--nats-credentials",
        str(deployment.seed(OPERATOR)),
        "--nats-ca",
        str(deployment.ca),
    ]
    archive = str(tmp_path / "archive")
    args = ["log", "archive", *credentials, "--to", archive, "--up-to", str(last)]
    assert await asyncio.to_thread(main, args) == 0, capfd.readouterr().err
    first_before, _ = await sequences(deployment)

    async def refused(user: str) -> list[str]:
        """The purge request with ``user``'s credential: what the server did not refuse."""
        violations = Violations()
        nc = await client(deployment, user, violations)
        try:
            subject = f"$JS.API.STREAM.PURGE.{STREAM}"
            await nc.publish(subject, json.dumps({"seq": last + 1}).encode(), reply=nc.new_inbox())
            return await violations.wait_for([subject])
        finally:
            await nc.close()

    not_refused = await asyncio.gather(*(refused(user) for user in SERVICE_USERS))
    assert not_refused == [[] for _ in SERVICE_USERS]
    assert (await sequences(deployment))[0] == first_before  # nothing was purged

    purge = ["log", "purge", *credentials, "--archive", archive, "--up-to", str(last)]
    assert await asyncio.to_thread(main, purge) == 0, capfd.readouterr().err
    assert f"purged {last - first_before + 1} entries up to sequence {last}" in (
        capfd.readouterr().out
    )
    first, end = await sequences(deployment)
    assert first == last + 1 and end == last


async def test_the_operator_appends_nothing_and_cannot_delete_the_stream(
    deployment: Deployment,
) -> None:
    await appended(deployment, 1)
    violations = Violations()
    nc = await client(deployment, OPERATOR, violations)
    try:
        forbidden = [node_entry_subject(NODES[0], writer=w) for w in WRITERS] + [
            f"$JS.API.STREAM.DELETE.{STREAM}",
            f"$JS.API.STREAM.MSG.DELETE.{STREAM}",
            f"$JS.API.STREAM.UPDATE.{STREAM}",
            f"$JS.API.STREAM.RESTORE.{STREAM}",
        ]
        for subject in forbidden:
            await nc.publish(subject, encode_envelope(ENVELOPES[0]), reply=nc.new_inbox())
        assert await violations.wait_for(forbidden) == [], violations.seen
        info = await nc.jetstream(timeout=5).stream_info(STREAM)
        assert info.config.name == STREAM
    finally:
        await nc.close()


def test_the_operator_seed_is_in_no_secret_a_service_mounts(deployment: Deployment) -> None:
    seed = deployment.seed(OPERATOR).read_bytes()
    text = (deployment.seed(OPERATOR).parent / KUBERNETES_SECRETS).read_text()
    mounted = [
        base64.b64decode(value)
        for document in text.split("---\n")
        if document.strip()
        for value in json.loads(document)["data"].values()
    ]
    assert mounted and seed not in mounted
    assert all(seed.strip() not in value for value in mounted)
