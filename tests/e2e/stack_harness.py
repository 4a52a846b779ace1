"""Helpers for end-to-end tests: a real local stack (nats-server + the four services as
processes), real `gpupool run` workloads, and the log read back from JetStream."""

from __future__ import annotations

import asyncio
import re
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from gpupool.cli.local_stack import LocalStack, StackSettings, local_stack
from gpupool.eventlog.jetstream import JetStreamEventLog
from gpupool.eventlog.port import Entry, StoredEvent
from gpupool.events import Envelope, event_pod

WAITING = re.compile(r"^You have been waiting for (\d+) seconds\. Approximate position: (\d+)$")


@asynccontextmanager
async def running_stack(
    tmp_path: Path,
    cluster_yaml: str,
    node: str,
    *,
    gpus: int,
    start: bool = True,
    identity: str = "request",
    run_in: str = "executor",
) -> AsyncIterator[LocalStack]:
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(cluster_yaml)
    settings = StackSettings(
        cluster_file=cluster,
        node=node,
        state_dir=tmp_path / "state",
        simulate_gpus=gpus,
        message_period=0.5,
        log_level="INFO",
        identity=identity,
        run_in=run_in,
    )
    async with local_stack(settings, start=start) as stack:
        try:
            yield stack
        except BaseException:
            for name, service in stack.services.items():  # shown by pytest on failure
                print(f"----- {name} log -----\n{service.log_tail(60)}")
            raise


async def read_log(stack: LocalStack) -> list[Entry]:
    log = await JetStreamEventLog.connect(stack.nats_url)
    try:
        return [entry async for entry in log.replay()]
    finally:
        await log.close()


def envelopes(entries: list[Entry]) -> list[Envelope]:
    return [entry.envelope for entry in entries if isinstance(entry, StoredEvent)]


async def wait_for_log(
    stack: LocalStack,
    condition: Callable[[list[Envelope]], bool],
    *,
    within: float = 30.0,
) -> list[Envelope]:
    """Follow the stack's log until ``condition`` holds for everything seen so far."""
    return await follow_log(stack.nats_url, condition, within=within)


async def follow_log(
    url: str,
    condition: Callable[[list[Envelope]], bool],
    *,
    within: float = 30.0,
) -> list[Envelope]:
    """Follow the log at ``url`` (a durable consumer from the start) until ``condition`` holds."""
    log = await JetStreamEventLog.connect(url)
    seen: list[Envelope] = []
    try:
        async with asyncio.timeout(within):
            subscription = log.subscribe(durable=f"test-follow-{uuid.uuid4().hex[:8]}")
            try:
                async for delivery in subscription:
                    await delivery.ack()
                    for entry in delivery.entries:
                        if isinstance(entry, StoredEvent):
                            seen.append(entry.envelope)
                    if condition(seen):
                        return seen
            finally:
                await subscription.aclose()
    finally:
        await log.close()
    raise AssertionError(f"the log ended before the condition held: {seen}")


def of_type(events: list[Envelope], kind: type, pod: str | None = None) -> list[Envelope]:
    return [
        e
        for e in events
        if isinstance(e.event, kind)
        and (pod is None or ((ref := event_pod(e.event)) is not None and ref.name == pod))
    ]


@dataclass
class Workload:
    """A `gpupool run` process, its output collected line by line."""

    pod: str
    process: asyncio.subprocess.Process
    lines: list[str] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    reader: asyncio.Task[None] | None = None

    async def _read(self) -> None:
        assert self.process.stdout is not None
        async for raw in self.process.stdout:
            self.lines.append(raw.decode(errors="replace").rstrip("\n"))
            self.changed.set()
        self.changed.set()

    async def until_line(self, predicate: Callable[[str], bool], *, within: float = 30.0) -> str:
        async with asyncio.timeout(within):
            while True:
                for line in self.lines:
                    if predicate(line):
                        return line
                if (
                    self.process.returncode is not None
                    and self.reader is not None
                    and self.reader.done()
                ):
                    raise AssertionError(f"{self.pod} exited without such a line: {self.lines}")
                self.changed.clear()
                await self.changed.wait()

    def waiting(self) -> list[tuple[int, int]]:
        found = []
        for line in self.lines:
            match = WAITING.match(line)
            if match:
                found.append((int(match.group(1)), int(match.group(2))))
        return found

    async def finish(self) -> int:
        assert self.process.stdin is not None
        with suppress(ConnectionError):
            self.process.stdin.write(b"done\n")
            await self.process.stdin.drain()
        return await self.exit_code()

    async def exit_code(self, within: float = 30.0) -> int:
        async with asyncio.timeout(within):
            code = await self.process.wait()
            if self.reader is not None:
                await self.reader
        return code


STDIN_WORKLOAD = (
    "import os, sys; print('running on', os.environ['CUDA_VISIBLE_DEVICES'], flush=True); "
    "sys.stdin.readline()"
)


async def start_workload(
    stack: LocalStack, pod: str, *, command: list[str] | None = None, extra: list[str] | None = None
) -> Workload:
    argv = command if command is not None else [sys.executable, "-c", STDIN_WORKLOAD]
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gpupool.cli.main",
        "run",
        "--socket",
        str(stack.socket_path),
        "--pod",
        pod,
        *(extra or []),
        "--",
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    workload = Workload(pod=pod, process=process)
    workload.reader = asyncio.create_task(workload._read())
    return workload
