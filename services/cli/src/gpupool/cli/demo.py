"""``gpupool demo``: the worked example (docs/behaviour.md), live, through all four services.

Four real processes run as pods A–D on one node with two SIMULATED GPUs (there
is no GPU here; the output says so). Each pod's command is started by the
node-executor once the admission-queue assigns it a GPU; C's task is ended by
the demo at T2. The timeline printed is the log itself, as it is appended.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TextIO

from gpupool.cli.local_stack import StackSettings, local_stack
from gpupool.eventlog.jetstream import JetStreamEventLog
from gpupool.eventlog.port import StoredEvent
from gpupool.events import Assigned, Envelope, PodReady, Preempted, Released, event_pod, event_tag

NODE = "cn-wulanchabu-c.cr-xxx"
EXPECTED_ASSIGNMENTS = [("pod-a", 0), ("pod-c", 1), ("pod-d", 1), ("pod-b", 0)]
"""The worked example: A on GPU 0, C on GPU 1; at T2 D gets GPU 1, then B GPU 0 beside A."""

WORKLOAD = (
    "import os, sys; "
    "print(os.environ['GPUPOOL_POD'], 'works on', os.environ['CUDA_VISIBLE_DEVICES'], "
    "'core limit', os.environ.get('CUDA_MPS_ACTIVE_THREAD_PERCENTAGE'), flush=True); "
    "sys.stdin.readline()"
)
"""Each pod's task: say where it runs, then work until the demo ends it (a line on stdin)."""


def find_worked_example() -> Path:
    for base in (Path.cwd(), *Path(__file__).resolve().parents):
        candidate = base / "scenarios" / "worked-example.yaml"
        if candidate.is_file():
            return candidate
    raise FileNotFoundError("scenarios/worked-example.yaml not found (run from the repository)")


@dataclass
class PodProcess:
    name: str
    process: asyncio.subprocess.Process
    lines: list[str] = field(default_factory=list)
    new_line: asyncio.Event = field(default_factory=asyncio.Event)

    async def finish(self) -> int:
        assert self.process.stdin is not None
        with contextlib.suppress(ConnectionError):
            self.process.stdin.write(b"done\n")
            await self.process.stdin.drain()
        return await self.process.wait()


class DemoStack(Protocol):
    """What the demo needs of a stack: its NATS and the node-executor's workload socket."""

    @property
    def nats_url(self) -> str: ...

    @property
    def socket_path(self) -> Path: ...


PodCommand = Callable[[str, str], list[str]]
"""(pod name, the pod's Python task) -> the argv that runs it as a pod through ``gpupool run``."""


def local_pod_command(stack: DemoStack) -> PodCommand:
    """``gpupool run`` on this machine, the task run by this interpreter."""

    def command(pod: str, task: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "gpupool.cli.main",
            "run",
            "--socket",
            str(stack.socket_path),
            "--pod",
            pod,
            "--",
            sys.executable,
            "-c",
            task,
        ]

    return command


@dataclass
class DemoRun:
    stack: DemoStack
    out: TextIO
    pod_command: PodCommand | None = None
    """How a pod is started (default: ``gpupool run`` here); the compose test runs it in a container."""
    started: float = field(default_factory=time.monotonic)
    events: list[Envelope] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    pods: dict[str, PodProcess] = field(default_factory=dict)
    echoes: list[asyncio.Task[None]] = field(default_factory=list)

    def say(self, text: str) -> None:
        self.out.write(f"[{time.monotonic() - self.started:6.2f}s] {text}\n")
        self.out.flush()

    async def follow_log(self) -> None:
        log = await JetStreamEventLog.connect(self.stack.nats_url)
        try:
            subscription = log.subscribe(durable=f"demo-{id(self)}")
            async for delivery in subscription:
                await delivery.ack()
                for entry in delivery.entries:
                    if not isinstance(entry, StoredEvent):
                        continue
                    self.events.append(entry.envelope)
                    self.say(f"log #{entry.seq:<3} {describe(entry.envelope)}")
                self.changed.set()
        finally:
            await log.close()

    async def until(self, what: str, condition: Callable[[], bool], within: float = 60.0) -> None:
        async with asyncio.timeout(within):
            while not condition():
                self.changed.clear()
                await self.changed.wait()
        del what

    def assigned(self) -> list[tuple[str, int]]:
        return [
            (event.pod.name, event.gpu_index)
            for event in (e.event for e in self.events)
            if isinstance(event, Assigned)
        ]

    def has(self, kind: type, pod: str) -> bool:
        return any(
            isinstance(e.event, kind)
            and (ref := event_pod(e.event)) is not None
            and ref.name == pod
            for e in self.events
        )

    async def start_pod(self, name: str) -> PodProcess:
        argv = (self.pod_command or local_pod_command(self.stack))(name, WORKLOAD)
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        pod = PodProcess(name=name, process=process)
        self.pods[name] = pod
        self.echoes.append(asyncio.create_task(self._echo(pod)))
        return pod

    async def _echo(self, pod: PodProcess) -> None:
        assert pod.process.stdout is not None
        async for raw in pod.process.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            pod.lines.append(line)
            self.say(f"{pod.name} | {line}")
            pod.new_line.set()
            self.changed.set()

    def waiting_lines(self, pod: str) -> list[str]:
        return [
            line for line in self.pods[pod].lines if line.startswith("You have been waiting for ")
        ]


async def run_worked_example(run: DemoRun) -> list[tuple[str, int]]:
    """Drive pods A–D through the worked example; returns the (pod, GPU) assignments in order."""
    follower = asyncio.create_task(run.follow_log())
    try:
        run.say("pod-a becomes ready (it wants a GPU)")
        await run.start_pod("pod-a")
        await run.until("A runs", lambda: run.has(Assigned, "pod-a"))
        run.say("pod-c becomes ready")
        await run.start_pod("pod-c")
        await run.until("C runs", lambda: run.has(Assigned, "pod-c"))
        run.say(
            "pod-d becomes ready: the head of the queue; GPU 0 has 50 idle but D's limit is 100"
        )
        await run.start_pod("pod-d")
        await run.until("D queued", lambda: run.has(PodReady, "pod-d"))
        run.say("pod-b becomes ready: it waits behind D (the queue is served in order)")
        await run.start_pod("pod-b")
        await run.until(
            "T1: B and D report their positions",
            lambda: bool(run.waiting_lines("pod-b")) and bool(run.waiting_lines("pod-d")),
        )
        run.say("T1 reached: A on GPU 0, C on GPU 1; D waits at position 1, B at position 2")
        run.say("T2: pod-c's task completes")
        code = await run.pods["pod-c"].finish()
        await run.until(
            "D and B run", lambda: run.has(Assigned, "pod-d") and run.has(Assigned, "pod-b")
        )
        run.say(
            f"pod-c exited with {code}; D got GPU 1 (phase 1), then B runs beside A on GPU 0 (phase 2)"
        )
        for name in ("pod-a", "pod-d", "pod-b"):
            await run.pods[name].finish()
        await run.until(
            "all released",
            lambda: sum(isinstance(e.event, Released) for e in run.events) >= 4,
        )
        return run.assigned()
    finally:
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower
        for pod in run.pods.values():
            if pod.process.returncode is None:
                pod.process.kill()
                await pod.process.wait()


def describe(envelope: Envelope) -> str:
    event = envelope.event
    tag = event_tag(event)
    match event:
        case Assigned():
            return f"{tag:<21} {event.pod.name} -> GPU {event.gpu_index} ({event.gpu_uuid})"
        case Preempted():
            return (
                f"{tag:<21} {event.victim.name} by {event.preemptor.name} on GPU {event.gpu_index}"
            )
        case Released():
            return f"{tag:<21} {event.pod.name} ({event.reason}) from GPU {event.gpu_index}"
        case _:
            pod = getattr(event, "pod", None)
            return f"{tag:<21} {pod.name if pod is not None else event.node}"


async def demo(args: argparse.Namespace, out: TextIO) -> int:
    scenario = args.scenario or find_worked_example()
    with tempfile.TemporaryDirectory(prefix="gpupool-demo-") as tmp:
        settings = StackSettings(
            cluster_file=scenario,
            node=NODE,
            state_dir=Path(tmp),
            nats_url=args.nats,
            simulate_gpus=2,
            message_period=args.message_period,
            log_level="WARNING",
        )
        out.write(
            "gpupool demo: the worked example (docs/behaviour.md), live through the policy, "
            "admission-queue, preemption and node-executor services.\n"
            f"The node {NODE} has 2 SIMULATED GPUs (no NVML here; --simulate-gpus 2).\n"
        )
        async with local_stack(settings) as stack:
            ports = ", ".join(f"{n} :{s.port}" for n, s in stack.services.items())
            out.write(f"NATS {stack.nats_url}; services (metrics at /metrics): {ports}\n\n")
            run = DemoRun(stack=stack, out=out)
            assignments = await run_worked_example(run)
    out.write(
        "\nAssignments in order: " + ", ".join(f"{p} -> GPU {g}" for p, g in assignments) + "\n"
    )
    if assignments == EXPECTED_ASSIGNMENTS:
        out.write("This is exactly the worked example's order.\n")
        return 0
    out.write(f"MISMATCH: the worked example expects {EXPECTED_ASSIGNMENTS}\n")
    return 1


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("demo", help="run the worked example live through all services")
    parser.add_argument(
        "--scenario", type=Path, help="cluster file (default scenarios/worked-example.yaml)"
    )
    parser.add_argument("--nats", help="use this NATS server instead of starting one")
    parser.add_argument(
        "--message-period",
        type=float,
        default=1.0,
        help="seconds between waiting messages (default 1 for the demo)",
    )
    parser.set_defaults(handler=lambda args: asyncio.run(demo(args, sys.stdout)))
