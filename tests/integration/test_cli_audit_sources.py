"""The audit commands as real processes on both log sources: a live JetStream stream and a growing file."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from gpupool.eventlog import JetStreamEventLog
from gpupool.events import Envelope, PodReady, PodRef, decode_envelope, encode_envelope

ROOT = Path(__file__).resolve().parents[2]
GPUPOOL = str(ROOT / ".venv" / "bin" / "gpupool")
NODE = "cn-wulanchabu-c.cr-xxx"
PROCESS_TIMEOUT_S = 60.0

pytestmark = pytest.mark.integration


async def gpupool(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        GPUPOOL,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=ROOT,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=PROCESS_TIMEOUT_S)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


@pytest.fixture(scope="module")
def worked_example_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gpupool.cli.main import main

    target = tmp_path_factory.mktemp("logs") / "worked-example.jsonl"
    assert (
        main(["simulate", str(ROOT / "scenarios" / "worked-example.yaml"), "-o", str(target)]) == 0
    )
    return target


def envelopes_of(path: Path) -> list[Envelope]:
    return [decode_envelope(line) for line in path.read_bytes().splitlines()]


def nats_arguments(nats_url: str, log: JetStreamEventLog) -> list[str]:
    return ["--nats", nats_url, "--stream", log.stream, "--subject-prefix", log.subject_prefix]


async def test_the_audit_reads_jetstream_as_it_reads_the_file(
    nats_url: str, jetstream_log: JetStreamEventLog, worked_example_log: Path
) -> None:
    """The same envelopes in a stream: the same sequences, so the same history and state."""
    await jetstream_log.append_many(envelopes_of(worked_example_log))
    source = nats_arguments(nats_url, jetstream_log)
    from_file = ["--log", str(worked_example_log)]
    for command in (
        ["history", "pod-b"],
        ["state", "--at", "+5s"],
        ["explain", "pod-b", "--at", "+5s"],
    ):
        live, recorded = await asyncio.gather(
            gpupool(*command, *source), gpupool(*command, *from_file)
        )
        assert live[0] == recorded[0] == 0, (command, live[2], recorded[2])
        assert live[1] == recorded[1], command
    code, out, _ = await gpupool("verify", *source)
    assert code == 0
    assert out.splitlines()[0] == (
        "verify: OK, 15 entries (0 unreadable), 1 node, 4 pods, 4 assignments, "
        "0 preemptions, 1 release"
    )


async def test_verify_on_jetstream_counts_garbage_and_fails_on_a_conflict(
    nats_url: str, jetstream_log: JetStreamEventLog, worked_example_log: Path
) -> None:
    envelopes = envelopes_of(worked_example_log)
    await jetstream_log.append_many(envelopes[:12])
    await jetstream_log.append_raw(
        f"{jetstream_log.subject_prefix}.{NODE.replace('.', '_')}.PodReady", b"{oops"
    )
    conflicting = envelopes[7]  # A's Assigned on GPU 0, again, under a new id
    await jetstream_log.append(
        Envelope(id="again", time=envelopes[11].time, event=conflicting.event)
    )
    code, out, _ = await gpupool("verify", *nats_arguments(nats_url, jetstream_log))
    assert code == 1
    assert out.splitlines() == [
        "violation at #14 (id again, Assigned, pod default/pod-a): double assignment: "
        "default/pod-a already holds GPU 0 (assigned again to GPU 0)",
        "verify: FAILED, 1 violation; 14 entries (1 unreadable), 1 node, 4 pods, "
        "3 assignments, 0 preemptions, 0 releases",
        # what the services set aside, with the reason: the garbage, and the second Assigned
        # of a pod already running (it is reported, and not believed)
        "  set aside #13: not a gpupool envelope: JSON is malformed: object keys must be "
        "strings (byte 1)",
        "  set aside #14: EventOutOfOrder: default/pod-a was assigned while running, not ready",
    ]


async def read_line(stream: asyncio.StreamReader) -> str:
    line = await asyncio.wait_for(stream.readline(), timeout=PROCESS_TIMEOUT_S)
    assert line, "the follower ended"
    return line.decode().rstrip("\n")


async def follow_one_more(
    arguments: list[str], existing: int, append: Callable[[], Awaitable[None]]
) -> str:
    """Start ``gpupool log --json --follow``, read the existing lines, append, read the new one."""
    process = await asyncio.create_subprocess_exec(
        GPUPOOL, "log", "--json", "--follow", *arguments, stdout=asyncio.subprocess.PIPE, cwd=ROOT
    )
    assert process.stdout is not None
    try:
        for _ in range(existing):
            await read_line(process.stdout)
        await append()
        return await read_line(process.stdout)
    finally:
        process.terminate()
        await asyncio.wait_for(process.wait(), timeout=PROCESS_TIMEOUT_S)


def a_new_ready() -> Envelope:
    return Envelope(
        id="later-1",
        time=decode_envelope(
            b'{"id":"x","time":"2025-01-01T00:02:00Z","event":{"type":"PodRemoved","pod":{"namespace":"default","name":"pod-c"},"node":"n"}}'
        ).time,
        event=PodReady(pod=PodRef(namespace="default", name="pod-c"), node=NODE),
    )


def append_line(path: Path, line: bytes) -> None:
    with path.open("ab") as handle:
        handle.write(line + b"\n")


@pytest.fixture
def growing_log(worked_example_log: Path, tmp_path: Path) -> Path:
    growing = tmp_path / "growing.jsonl"
    growing.write_bytes(worked_example_log.read_bytes())
    return growing


async def test_follow_a_growing_file(growing_log: Path) -> None:
    new = encode_envelope(a_new_ready())

    async def append() -> None:
        await asyncio.to_thread(append_line, growing_log, new)

    line = await follow_one_more(["--log", str(growing_log)], 15, append)
    assert line == new.decode()


async def test_follow_a_live_stream(
    nats_url: str, jetstream_log: JetStreamEventLog, worked_example_log: Path
) -> None:
    await jetstream_log.append_many(envelopes_of(worked_example_log))
    envelope = a_new_ready()

    async def append() -> None:
        await jetstream_log.append(envelope)

    line = await follow_one_more(nats_arguments(nats_url, jetstream_log), 15, append)
    assert line == encode_envelope(envelope).decode()
