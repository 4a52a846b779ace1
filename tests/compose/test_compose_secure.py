"""compose.yaml with deploy/compose/secure.yaml on a real Docker engine: NATS with TLS and
one nkey user per service, the credentials made by the documented step.

The credentials come from ``gpupool credentials generate`` (``--tls-name 127.0.0.1``)
into a directory given to compose as GPUPOOL_CREDENTIALS_DIR and owned by the
images' user (10001), exactly as docs/security.md says. What is proved:

* every service connects with its own credential over TLS and turns ready;
* a pod runs through the stack (``gpupool run`` inside the executor's container);
* the log, read with the ``reader`` credential, holds each event under the writer
  that produces it, and ``gpupool verify`` finds nothing wrong;
* an anonymous client, and a client that speaks plain text, are refused;
* NATS monitoring listens on the loopback only.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import nats
import nats.errors
import pytest
from test_compose_stack import (
    EXECUTOR,
    NATS_URL,
    ROOT,
    SERVICE_PORTS,
    ComposeStack,
    running_stack,
    wait_ready,
)

from gpupool.cli.demo import NODE
from gpupool.eventlog.credentials import CA_CERT, READER, connect_options, write_credentials
from gpupool.eventlog.port import StoredEvent
from gpupool.eventlog.reader import ReadOnlyLog
from gpupool.eventlog.subjects import node_token, writer_of_subject
from gpupool.events import Assigned, GpuInventoryReported, PodReady, PodRegistered, Released

pytestmark = [pytest.mark.docker, pytest.mark.timeout(900)]

TLS_URL = "tls://127.0.0.1:4222"
IMAGE_USER = 10001
MONITORING_PORT = 8222


class SecureStack:
    def __init__(self, stack: ComposeStack, credentials: Path) -> None:
        self.stack = stack
        self.credentials = credentials

    @property
    def reader(self) -> Path:
        return self.credentials / f"{READER}.nk"

    @property
    def ca(self) -> Path:
        return self.credentials / CA_CERT


@pytest.fixture(scope="module")
def secure_stack(
    compose_images: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SecureStack]:
    credentials = tmp_path_factory.mktemp("compose-credentials")
    # the documented step: generate, then hand the files to the images' user
    write_credentials(credentials, nodes=[NODE], tls_names=("127.0.0.1", "localhost"))
    for path in (credentials, *credentials.rglob("*")):
        os.chown(path, IMAGE_USER, IMAGE_USER)
    files = ["-f", str(ROOT / "compose.yaml"), "-f", str(ROOT / "deploy/compose/secure.yaml")]
    environment = {
        "GPUPOOL_CREDENTIALS_DIR": str(credentials),
        "GPUPOOL_NODE_CREDENTIALS": f"node-executor-{node_token(NODE)}.nk",
    }
    with running_stack(compose_images, files, environment) as stack:
        yield SecureStack(stack, credentials)


def listening_addresses(port: int) -> set[str]:
    """The IPv4 addresses something listens on at ``port`` (from /proc/net/tcp)."""
    found: set[str] = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:  # LISTEN
            found.add(".".join(str(int(address[i : i + 2], 16)) for i in (6, 4, 2, 0)))
    return found


async def test_a_pod_runs_through_the_stack_with_tls_and_a_user_per_service(
    secure_stack: SecureStack,
) -> None:
    stack = secure_stack.stack
    for port in SERVICE_PORTS.values():
        await wait_ready(port)
    ran = await asyncio.to_thread(
        subprocess.run,
        [*stack.pod_command("pod-a", "print('pod-a ran')")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert ran.returncode == 0, f"{ran.stdout}\n{ran.stderr}\n{stack.logs()}"
    assert "pod-a ran" in ran.stdout
    assert "gpupool: running on GPU" in ran.stderr

    # The log, read with the reader's credential: each event under the writer producing it.
    log = await ReadOnlyLog.connect(
        TLS_URL, credentials=secure_stack.reader, tls_ca=secure_stack.ca
    )
    try:
        writers: dict[str, set[str]] = {}
        async for entry in log.entries(until_seq=await log.last_seq()):
            assert isinstance(entry, StoredEvent), entry
            name = type(entry.envelope.event).__name__
            writers.setdefault(name, set()).add(str(writer_of_subject(entry.subject)))
    finally:
        await log.close()
    assert writers[GpuInventoryReported.__name__] == {"node-executor"}
    assert writers[PodRegistered.__name__] == {"policy"}
    assert writers[PodReady.__name__] == {"node-executor"}
    assert writers[Assigned.__name__] == {"admission-queue"}
    assert writers[Released.__name__] == {"node-executor"}
    assert "MessageRejected" not in writers

    verified = await asyncio.to_thread(
        subprocess.run,
        [str(ROOT / ".venv" / "bin" / "gpupool"), "verify", "--nats", TLS_URL],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "GPUPOOL_NATS_CREDENTIALS": str(secure_stack.reader),
             "GPUPOOL_NATS_CA": str(secure_stack.ca)},
    )  # fmt: skip
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "violation" not in verified.stdout.lower().replace("no violation", ""), verified.stdout
    assert stack.health(EXECUTOR) in ("healthy", "starting")


async def test_an_anonymous_or_plain_text_client_is_refused(secure_stack: SecureStack) -> None:
    await wait_ready(SERVICE_PORTS["policy"])
    trusting = ssl.create_default_context(cafile=str(secure_stack.ca))
    errors: list[Exception] = []

    async def error(exc: Exception) -> None:
        errors.append(exc)

    with pytest.raises((nats.errors.Error, OSError)):
        await nats.connect(
            TLS_URL, tls=trusting, error_cb=error, allow_reconnect=False,
            max_reconnect_attempts=0, connect_timeout=5,
        )  # fmt: skip
    assert any("authorization violation" in str(e).lower() for e in errors), errors
    with pytest.raises((nats.errors.Error, OSError)):  # the server requires TLS
        await nats.connect(
            NATS_URL, error_cb=error, allow_reconnect=False, max_reconnect_attempts=0,
            connect_timeout=5,
        )  # fmt: skip
    # the reader's credential is accepted over the same TLS: the refusals are about the client
    accepted = await nats.connect(
        TLS_URL, allow_reconnect=False, connect_timeout=5,
        **connect_options(secure_stack.reader, secure_stack.ca),
    )  # fmt: skip
    await accepted.close()
    # monitoring (no authentication of its own) is on the loopback only
    assert listening_addresses(MONITORING_PORT) == {"127.0.0.1"}
