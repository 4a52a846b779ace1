"""Decisions at the speed of the log: the decision-speed table, each figure beside a raw
baseline measured in the same run, the ratio and the goal; then the scaling tables.

    .venv/bin/python bench/bench_decisions.py [--burst 2000] [--latency 300] [--log-only]
        [--latency-only] [--observer process|in-process] [--split]

On one local nats-server (a fresh stream per measurement), in this process, with the
services' own code (``DeciderLoop``, ``AdmissionQueue``, each writer on its own
connection, as the services run):

* latency: a node-executor makes a pod ready (``RequestGpu`` -> PodReady appended);
  the admission-queue, following the log, decides and appends the Assigned; an
  observer (an ordered consumer of the whole log) receives both. From PodReady stored
  to Assigned stored by the server's store times (the timestamps in the observer's
  deliveries' reply subjects, as bench_services.py times it); beside it, both arrivals
  at the observer (its wake-up for the PodReady reads it low), and the row from the
  PodReady's PubAck in this process (the row before 2026-12-02 #12, which reads low once
  the decision runs before this process takes the PubAck: docs/benchmarks.md, "Deciding
  in the reader's step"). Baseline:
  one raw JetStream publish -> arrival at an ordered consumer of the same kind, same
  server, one before each pod (interleaved), both samples started from an idle loop.
  The observers run in another process (``--observer process``, the default: neither
  arrival waits for this process's loop, which also carries the executor and the
  admission-queue) or in this one (``--observer in-process``). ``--split`` stamps the
  points of each decision (bytes read, handed to the subscription, taken by the
  consumer, reacting, decide, append, written to the socket, arrived, PubAck) and
  prints their medians after the PodReady's acknowledgement; ``--latency-only`` runs
  this row alone.
* burst: N PodReady appended at once (pipelined) through one admission-queue on
  1, 16, 256, 1,024 nodes: placements per second from the first PodReady sent to the
  last Assigned folded; the PodReady appended by this process (sharing its event loop
  with the admission-queue), then by another process (as a node-executor is deployed).
  Baseline: the raw ``publish_async`` ceiling, the same N messages pipelined on the
  same server, measured before and after the bursts (their mean is the ratio's base).
* core: ``Schedule`` with the head blocked (bench_core's state) at 100, 1,000, 10,000
  waiting, decisions per second; and a burst of N PodReady, each folded and followed
  by a Schedule, for N = 100, 1,000, 3,000 (linear: the per-event cost stays flat).
* preemption timer pass: the deadlines the preemption service computes after an
  event (``next_preemption_check`` for every node), at 1, 16, 256, 1,024 nodes.

* rebuild: bench_rebuild's log folded from zero in memory (decode + fold, with the
  metrics), against decoding it alone.
* simulate: the core's Simulator (what ``gpupool simulate`` runs) on 16 nodes x 16
  GPUs, 10,000 pods (``--simulate``), each made ready twice: events per CPU-second.

``--cpu-only`` prints the pure-CPU rows alone (core, preemption timer, rebuild,
simulate), without starting a nats-server.

The rebuild row is measured by bench_rebuild.py (docs/benchmarks.md). Prints
tables; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import nats
from nats.aio.msg import Msg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import build_state, rate
from gpupool.admission_queue.service import AdmissionQueue
from gpupool.core import (
    ReportRelease,
    RequestGpu,
    Schedule,
    State,
    decide,
    evolve,
    next_preemption_check,
)

try:  # absent before the incremental core: the same bench then measures the old code
    from gpupool.core import PreemptionDeadlines, assignment_holds
except ImportError:  # pragma: no cover
    PreemptionDeadlines = None  # type: ignore[assignment,misc]

    def assignment_holds(state: State, event: Assigned) -> bool:  # type: ignore[misc]
        pod = state.pods.get(event.pod)
        return pod is not None and pod.phase == "ready"


from gpupool.eventlog import JetStreamEventLog
from gpupool.eventlog.nats_server import run_nats_server
from gpupool.eventlog.port import StoredEvent
from gpupool.eventlog.subjects import subject_for
from gpupool.events import (
    Assigned,
    Envelope,
    Event,
    GpuInfo,
    GpuInventoryReported,
    NodeConfigured,
    PodReady,
    PodRef,
    PodRegistered,
    QosConfig,
    Share,
    encode_envelope,
)
from gpupool.runtime.decider import DeciderLoop
from gpupool.runtime.heap import settle_after_rebuild

NOW = datetime(2025, 1, 1, tzinfo=UTC)
ms = 1000.0


def wrap(event: Event) -> Envelope:
    return Envelope(id=uuid.uuid4().hex, time=NOW, event=event)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def node_setup(node: str, gpus: int) -> list[Event]:
    return [
        GpuInventoryReported(
            node=node,
            gpus=tuple(GpuInfo(index=i, uuid=f"GPU-{node}-{i}", memory_mib=1) for i in range(gpus)),
            source="simulated",
        ),
        NodeConfigured(node=node, policy="share-pool", qos=QosConfig(), gpu_count=gpus),
    ]


def registration(pod: PodRef, node: str, limit: int) -> PodRegistered:
    return PodRegistered(
        pod=pod,
        node=node,
        policy="share-pool",
        requests=Share(core=1, memory=1),
        limits=Share(core=limit, memory=limit),
        priority=0,
        uid=pod.name,
    )


class Server:
    """Fresh streams on one nats-server; one connection per writer on each."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.opened: list[JetStreamEventLog] = []

    async def stream(self, *writers: str) -> list[JetStreamEventLog]:
        token = uuid.uuid4().hex[:8]
        logs = []
        for writer in writers:
            log = await JetStreamEventLog.connect(
                self.url,
                stream=f"BENCH_{token}",
                subject_prefix=f"bench_{token}.log",
                writer=writer.split("#")[0],
            )
            logs.append(log)
            self.opened.append(log)
        return logs

    async def close(self) -> None:
        for log in self.opened:
            await log.close()
        self.opened.clear()


async def raw_round_trip(url: str, count: int) -> list[float]:
    nc = await nats.connect(url)
    js = nc.jetstream()
    subject = f"rtt_{uuid.uuid4().hex[:8]}"
    await js.add_stream(name=subject.upper(), subjects=[subject])
    arrived: asyncio.Queue[float] = asyncio.Queue()

    async def on_msg(msg: Msg) -> None:
        arrived.put_nowait(time.perf_counter())

    await js.subscribe(subject, cb=on_msg, ordered_consumer=True)
    samples = []
    for _ in range(count):
        sent = time.perf_counter()
        await js.publish(subject, b"x")
        samples.append((await arrived.get()) - sent)
    await nc.close()
    return samples


async def raw_publish_async(url: str, count: int) -> float:
    """The ceiling: ``count`` messages pipelined with publish_async, msgs/s."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    subject = f"pa_{uuid.uuid4().hex[:8]}"
    await js.add_stream(name=subject.upper(), subjects=[subject])
    payload = b"x" * 300
    started = time.perf_counter()
    futures = [await js.publish_async(subject, payload) for _ in range(count)]
    await asyncio.gather(*futures)
    elapsed = time.perf_counter() - started
    await nc.close()
    return count / elapsed


OBSERVER = r"""
import asyncio, re, sys, time
import nats

NAME = re.compile(rb'"name":"([^"]+)"')

async def main(url, raw_subject, raw_stream, log_filter, log_stream):
    nc = await nats.connect(url)
    js = nc.jetstream()
    out = sys.stdout

    async def on_raw(msg):
        now = time.perf_counter()
        out.write(f"raw {msg.data.decode()} {now!r}\n")
        out.flush()

    async def on_log(msg):
        now = time.perf_counter()
        data = msg.data
        kind = "assigned" if b'"Assigned"' in data else "ready" if b'"PodReady"' in data else ""
        if kind:
            match = NAME.search(data)
            if match:
                # the server's store time, from the delivery's reply subject
                stored_ns = round(msg.metadata.timestamp.timestamp() * 1e9)
                out.write(f"{kind} {match.group(1).decode()} {now!r} {stored_ns}\n")
                out.flush()

    await js.subscribe(raw_subject, stream=raw_stream, cb=on_raw, ordered_consumer=True)
    await js.subscribe(log_filter, stream=log_stream, cb=on_log, ordered_consumer=True)
    out.write("ready\n")
    out.flush()
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    await nc.close()

asyncio.run(main(*sys.argv[1:6]))
"""
"""The latency row's observer, in a process of its own: an ordered consumer on the raw
baseline's subject and one on the admission-queue's subjects (the same kind, the same
process), each arrival stamped with ``time.perf_counter`` (CLOCK_MONOTONIC: one clock for
every process of the machine) before anything else is done with it."""


class Observer:
    """The observer process: arrivals by key (``raw <round>``, ``assigned <pod name>``)."""

    def __init__(self) -> None:
        self.process: asyncio.subprocess.Process | None = None
        self.arrived: dict[tuple[str, str], float] = {}
        self.stored_ns: dict[tuple[str, str], int] = {}
        """The log's entries by key: the server's store time (the delivery's reply subject)."""
        self.changed = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None

    async def start(
        self, url: str, raw_subject: str, raw_stream: str, log: JetStreamEventLog
    ) -> None:
        self.process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            OBSERVER,
            url,
            raw_subject,
            raw_stream,
            f"{log.subject_prefix}.>",
            log.stream,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert self.process.stdout is not None
        await self.process.stdout.readline()  # subscribed
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        async for line in self.process.stdout:
            kind, key, when, *stored = line.decode().split()
            self.arrived[(kind, key)] = float(when)
            if stored:
                self.stored_ns[(kind, key)] = int(stored[0])
            self.changed.set()

    async def wait(self, kind: str, key: str) -> float:
        while (kind, key) not in self.arrived:
            self.changed.clear()
            await self.changed.wait()
        return self.arrived[(kind, key)]

    async def stop(self) -> None:
        assert self.process is not None and self.process.stdin is not None
        self.process.stdin.write(b"stop\n")
        await self.process.wait()
        if self._reader is not None:
            await self._reader


QUIET_S = 0.002
"""The latency row's idle pause before each sample (raw and decision alike; ``--pause-ms``)."""

SPLIT_POINTS = (
    "executor written",
    "aq bytes read",
    "stored",
    "aq handed over",
    "aq taken",
    "aq reacting",
    "decide started",
    "decide done",
    "append called",
    "assigned written",
    "assigned arrived",
    "puback",
)
"""The stamps of ``--split``, in the order they usually come (relative to "stored")."""


_ABSENT = object()


class Stamps:
    """``--split``: perf_counter stamps of one decision, the first of each point per round."""

    def __init__(self) -> None:
        self.round: dict[str, float] = {}
        self.rounds: list[dict[str, float]] = []
        self._undo: list[tuple[object, str, object]] = []

    def __call__(self, point: str) -> None:
        if point not in self.round:
            self.round[point] = time.perf_counter()

    def next_round(self) -> None:
        if self.round:
            self.rounds.append(self.round)
        self.round = {}

    def instrument(
        self, executor_log: JetStreamEventLog, admission_log: JetStreamEventLog, service: object
    ) -> None:
        """Wrap the points of the path (instances, the subscription class, the decider's
        ``decide``; undone by :meth:`restore`). A point the code does not have (another
        transport) is left out of the table."""
        import gpupool.eventlog.jetstream as jetstream
        import gpupool.runtime.decider as decider

        stamp = self

        def wrap(owner: object, name: str, make: Callable[[Any], Any]) -> None:
            original = getattr(owner, name, None)
            if original is None:
                return
            self._undo.append((owner, name, vars(owner).get(name, _ABSENT)))
            setattr(owner, name, make(original))

        def on_writes(log: JetStreamEventLog, point: str, after: str | None) -> None:
            def make(writelines: Callable[..., object]) -> Callable[..., object]:
                def stamped(*args: object) -> object:
                    if after is None or after in stamp.round:
                        stamp(point)
                    return writelines(*args)

                return stamped

            transport = getattr(getattr(log, "_nc", None), "_transport", None)
            if transport is not None:
                wrap(transport, "writelines", make)

        on_writes(executor_log, "executor written", None)
        on_writes(admission_log, "assigned written", "append called")

        def make_parse(parse: Callable[[bytes], Awaitable[None]]) -> Callable[..., object]:
            async def parsed(data: bytes = b"") -> None:
                stamp("aq bytes read")
                await parse(data)

            return parsed

        parser = getattr(getattr(admission_log, "_nc", None), "_ps", None)
        if parser is not None:
            wrap(parser, "parse", make_parse)
        subscription = getattr(jetstream, "JetStreamSubscription", None)

        def make_handed(on_msg: Callable[..., Awaitable[None]]) -> Callable[..., object]:
            async def handed(sub: Any, msg: Msg) -> None:
                if getattr(sub, "durable", "") == "bench-aq":
                    stamp("aq handed over")
                await on_msg(sub, msg)

            return handed

        def make_taken(anext_: Callable[..., Awaitable[object]]) -> Callable[..., object]:
            async def taken(sub: Any) -> object:
                delivery = await anext_(sub)
                if getattr(sub, "durable", "") == "bench-aq":
                    stamp("aq taken")
                return delivery

            return taken

        if subscription is not None:
            wrap(subscription, "_on_msg", make_handed)
            wrap(subscription, "__anext__", make_taken)

        def make_reacting(react_batch: Callable[..., Awaitable[None]]) -> Callable[..., object]:
            async def reacting(entries: list[StoredEvent]) -> None:
                stamp("aq reacting")
                await react_batch(entries)

            return reacting

        wrap(service, "react_batch", make_reacting)

        def make_deciding(decide_: Callable[..., object]) -> Callable[..., object]:
            def deciding(state: State, command: object, now: datetime) -> object:
                if type(command) is Schedule:
                    stamp("decide started")
                    try:
                        return decide_(state, command, now)
                    finally:
                        stamp("decide done")
                return decide_(state, command, now)

            return deciding

        wrap(decider, "decide", make_deciding)

        def make_appending(append_decision: Callable[..., Awaitable[int]]) -> Callable[..., object]:
            async def appending(*args: object, **kwargs: object) -> int:
                stamp("append called")
                try:
                    return await append_decision(*args, **kwargs)
                finally:
                    stamp("puback")

            return appending

        wrap(admission_log, "append_decision", make_appending)

    def restore(self) -> None:
        """Undo :meth:`instrument` (the bursts after the latency row run unwrapped)."""
        while self._undo:
            owner, name, before = self._undo.pop()
            if before is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, before)

    def table(self) -> list[tuple[str, float, float, float, int]]:
        """Per point: median, p10, p90 of (point - stored) in ms, and how many rounds had it."""
        rows = []
        for point in SPLIT_POINTS:
            offsets = [r[point] - r["stored"] for r in self.rounds if point in r and "stored" in r]
            if offsets:
                rows.append(
                    (
                        point,
                        statistics.median(offsets) * ms,
                        percentile(offsets, 0.1) * ms,
                        percentile(offsets, 0.9) * ms,
                        len(offsets),
                    )
                )
        return rows


async def latency(
    server: Server,
    rounds: int,
    *,
    observer_process: bool = True,
    stamps: Stamps | None = None,
    pause_s: float = QUIET_S,
) -> tuple[list[float], list[float], list[float], list[float]]:
    """PodReady stored -> Assigned stored, one pod at a time on a 1-GPU node, by the server's
    store times of both (read from the observer's deliveries); the same as both arrivals at
    the observer's ordered consumer of the whole log; the same from the PodReady's PubAck
    in this process (the row before the observer saw PodReady); and the raw
    baseline, publish -> arrival, one round trip before each pod (interleaved: the same
    moments of the machine's load, the same loop with the services' consumers idle on it).

    ``observer_process``: both arrivals are seen by ordered consumers in one other process
    (:data:`OBSERVER`), so neither waits for this process's loop, which also handles the
    ``Assigned``'s PubAck and its deliveries to the executor and the admission-queue; else
    by ordered consumers in this process (the layout before the bench was made fair)."""
    # the setup is appended as a tool (DEFAULT_WRITER): the inventory and the node together
    setup, executor_log, admission_log = await server.stream(
        "gpupool", "node-executor", "admission-queue"
    )
    pods = [PodRef(namespace="bench", name=f"p{i:04d}") for i in range(rounds)]
    await setup.append_many(
        [wrap(e) for e in node_setup("n", 1)] + [wrap(registration(p, "n", 100)) for p in pods]
    )
    nc = await nats.connect(server.url)
    js = nc.jetstream()
    raw_subject = f"rtt_{uuid.uuid4().hex[:8]}"
    raw_stream = raw_subject.upper()
    await js.add_stream(name=raw_stream, subjects=[raw_subject])
    observer = Observer()
    if observer_process:
        await observer.start(server.url, raw_subject, raw_stream, setup)
    else:
        name = re.compile(rb'"name":"([^"]+)"')

        def arrived(kind: str, key: str, msg: Msg | None = None) -> None:
            observer.arrived[(kind, key)] = time.perf_counter()
            if msg is not None:  # the server's store time, from the delivery's reply subject
                stored = msg.metadata.timestamp.timestamp()
                observer.stored_ns[(kind, key)] = round(stored * 1e9)
            observer.changed.set()

        async def on_raw(msg: Msg) -> None:
            arrived("raw", msg.data.decode())

        async def on_log(msg: Msg) -> None:
            kind = (
                "assigned"
                if b'"Assigned"' in msg.data
                else "ready"
                if b'"PodReady"' in msg.data
                else ""
            )
            if kind and (match := name.search(msg.data)):
                arrived(kind, match.group(1).decode(), msg)

        await js.subscribe(raw_subject, stream=raw_stream, cb=on_raw, ordered_consumer=True)
        await js.subscribe(
            f"{setup.subject_prefix}.>",
            stream=setup.stream,
            cb=on_log,
            ordered_consumer=True,
        )
    executor = DeciderLoop(executor_log, service="node-executor")
    admission = DeciderLoop(admission_log, service="admission-queue")
    await executor.rebuild()
    await admission.rebuild()
    admission_folded = asyncio.Event()
    admission.projection.observers.append(lambda *_: admission_folded.set())
    service = AdmissionQueue()
    if stamps is not None:
        stamps.instrument(executor_log, admission_log, service)
    samples: list[float] = []
    arrivals: list[float] = []
    acked: list[float] = []
    raw: list[float] = []
    async with AsyncExitStack() as stack:
        await service.start(admission, stack)
        consumer = asyncio.create_task(consume(admission, service))
        folded = asyncio.Event()

        async def executor_folded(_: object) -> None:
            folded.set()

        follower = asyncio.create_task(executor.consume("bench-ex", executor_folded))

        async def quiet() -> None:
            """Both samples start from an idle loop: the services have folded everything
            (the last release, its echoes) and nothing else runs meanwhile."""
            last = executor.projection.last_seq
            while admission.projection.last_seq < last:
                admission_folded.clear()
                await admission_folded.wait()
            await service.settled()
            await asyncio.sleep(pause_s)

        for index, pod in enumerate(pods):
            await quiet()
            sent = time.perf_counter()
            await js.publish(raw_subject, str(index).encode())
            raw.append(await observer.wait("raw", str(index)) - sent)
            if stamps is not None:
                stamps.next_round()
            await quiet()
            await executor.execute(RequestGpu(pod=pod, node="n"), node="n")
            stored = time.perf_counter()
            if stamps is not None:
                stamps("stored")
            assigned = await observer.wait("assigned", pod.name)
            arrivals.append(assigned - await observer.wait("ready", pod.name))
            acked.append(assigned - stored)
            store_ns = observer.stored_ns
            samples.append((store_ns[("assigned", pod.name)] - store_ns[("ready", pod.name)]) / 1e9)
            # the executor folds the Assigned before it releases the pod
            while executor.projection.state.pods[pod].phase != "running":
                folded.clear()
                await folded.wait()
            if stamps is not None:
                stamps.round["assigned arrived"] = observer.arrived[("assigned", pod.name)]
            await executor.execute(ReportRelease(pod=pod, node="n", reason="completed"), node="n")
        if stamps is not None:
            stamps.next_round()
            stamps.restore()
        for task in (consumer, follower):
            task.cancel()
        await asyncio.gather(consumer, follower, return_exceptions=True)
    if observer_process:
        await observer.stop()
    await nc.close()
    return samples, arrivals, acked, raw


async def consume(loop: DeciderLoop, service: AdmissionQueue) -> None:
    batch = getattr(service, "react_batch", None)
    if batch is None:  # before batched consumption
        await loop.consume("bench-aq", service.react)
    elif not hasattr(service, "ack_before_reacting"):  # before acks left the decision path
        await loop.consume("bench-aq", service.react, react_batch=batch)
    elif not hasattr(service, "react_on_arrival"):  # before batches were taken in the reader
        await loop.consume(
            "bench-aq",
            service.react,
            react_batch=batch,
            ack_before_reacting=service.ack_before_reacting,
        )
    else:
        await loop.consume(
            "bench-aq",
            service.react,
            react_batch=batch,
            ack_before_reacting=service.ack_before_reacting,
            react_on_arrival=service.react_on_arrival,
        )


PUBLISHER = r"""
import asyncio, json, sys
import nats

async def main(url, path):
    nc = await nats.connect(url)
    js = nc.jetstream()
    with open(path) as file:
        items = json.load(file)
    print("ready", flush=True)
    sys.stdin.readline()
    futures = [
        await js.publish_async(subject, data.encode(), headers=headers)
        for subject, data, headers in items
    ]
    await asyncio.gather(*futures)
    await nc.close()

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""
"""A node-executor's burst from its own process: the PodReady, pipelined with publish_async
(the headers ``append_many`` sends), once told to go."""


class SeparatePublisher:
    """The burst's PodReady published by another process (as a node-executor is deployed)."""

    def __init__(
        self, url: str, log: JetStreamEventLog, envelopes: list[Envelope], workdir: Path
    ) -> None:
        path = workdir / f"burst-{uuid.uuid4().hex[:8]}.json"
        path.write_text(
            json.dumps(
                [
                    [
                        subject_for(e.event, prefix=log.subject_prefix, writer=log.writer),
                        encode_envelope(e).decode(),
                        {"Nats-Msg-Id": e.id, "Nats-Expected-Stream": log.stream},
                    ]
                    for e in envelopes
                ]
            )
        )
        self.url = url
        self.path = path
        self.process: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> SeparatePublisher:
        self.process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            PUBLISHER,
            self.url,
            str(self.path),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert self.process.stdout is not None
        await self.process.stdout.readline()  # connected and loaded
        return self

    def go(self) -> None:
        assert self.process is not None and self.process.stdin is not None
        self.process.stdin.write(b"go\n")

    async def __aexit__(self, *exc_info: object) -> None:
        assert self.process is not None
        await self.process.wait()
        self.path.unlink()


async def burst(
    server: Server, pods: int, nodes: int, *, separate: Path | None = None
) -> tuple[float, int]:
    """Placements per second of one admission-queue for a burst of ``pods`` PodReady.

    The PodReady are appended by this process (``append_many``), or, with ``separate`` (a
    scratch folder), by another process."""
    gpus = max(1, -(-pods // nodes // 100))
    # the setup is appended as a tool (DEFAULT_WRITER): the inventory and the node together
    setup, executor_log, admission_log = await server.stream(
        "gpupool", "node-executor", "admission-queue"
    )
    names = [f"b{i:05d}-{i % nodes:04d}" for i in range(pods)]
    refs = [PodRef(namespace="bench", name=name) for name in names]
    node_of = {ref: f"node-{i % nodes:04d}" for i, ref in enumerate(refs)}
    events: list[Event] = [e for n in range(nodes) for e in node_setup(f"node-{n:04d}", gpus)]
    events += [registration(ref, node_of[ref], 1) for ref in refs]
    await setup.append_many([wrap(e) for e in events])
    admission = DeciderLoop(admission_log, service="admission-queue")
    held = 0
    done = asyncio.Event()

    def count(state: State, folded: Envelope, _: int) -> None:
        nonlocal held
        event = folded.event
        if type(event) is Assigned and assignment_holds(state, event):
            held += 1
            if held == pods:
                done.set()

    admission.projection.observers.append(count)
    await admission.rebuild()
    settle_after_rebuild()  # as run_service does after the rebuild
    service = AdmissionQueue()
    async with AsyncExitStack() as stack:
        await service.start(admission, stack)
        consumer = asyncio.create_task(consume(admission, service))
        ready = [wrap(PodReady(pod=ref, node=node_of[ref])) for ref in refs]
        if separate is None:
            started = time.perf_counter()
            await executor_log.append_many(ready)
        else:
            publisher = await stack.enter_async_context(
                SeparatePublisher(server.url, executor_log, ready, separate)
            )
            started = time.perf_counter()
            publisher.go()
        try:
            async with asyncio.timeout(120):
                await done.wait()
        except TimeoutError:
            # a stalled burst must not pass for a slow one: its rate below counts what held
            print(
                f"burst of {pods} on {nodes} nodes STALLED: {held} of {pods} placements held "
                "after 120 s",
                file=sys.stderr,
            )
        elapsed = time.perf_counter() - started
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)
    await server.close()
    return held / elapsed, admission.conflicts


def core_burst(pods: int) -> float:
    """CPU seconds to fold a burst of ``pods`` PodReady, each followed by a Schedule (head
    blocked)."""
    state = build_state(0)
    node = next(iter(state.nodes))
    refs = [PodRef(namespace="bench", name=f"burst-{i:05d}") for i in range(pods)]
    for index, ref in enumerate(refs):
        evolve(state, Envelope(id=f"r{index}", time=NOW, event=registration(ref, node, 100)))
    started = time.process_time()
    for index, ref in enumerate(refs):
        evolve(state, Envelope(id=f"ready-{index}", time=NOW, event=PodReady(pod=ref, node=node)))
        decide(state, Schedule(node=node), NOW)
    return time.process_time() - started


def simulated(pods: int) -> tuple[int, float]:
    """``gpupool simulate`` (the core's Simulator) on 16 nodes x 16 GPUs: (events, cpu s)."""
    from gpupool.core.simulation import (
        Scenario,
        ScenarioAction,
        ScenarioNode,
        ScenarioPod,
        ScenarioShare,
        simulate,
    )

    nodes = [ScenarioNode(name=f"sim-{n:02d}", gpus=16) for n in range(16)]
    share = ScenarioShare(core=25, memory=25)
    scenario_pods = [
        ScenarioPod(
            name=f"p{i:05d}",
            node=f"sim-{i % 16:02d}",
            requests=ScenarioShare(core=1, memory=1),
            limits=share,
        )
        for i in range(pods)
    ]
    timeline = [
        ScenarioAction(at=at + i * 0.01, action="ready", pod=f"p{i:05d}", runs_for=30.0)
        for at in (0.0, 3600.0)
        for i in range(pods)
    ]
    scenario = Scenario(nodes=nodes, pods=scenario_pods, timeline=timeline)
    started = time.process_time()
    events = simulate(scenario)
    return len(events), time.process_time() - started


def rebuild_in_memory(entries: int) -> tuple[float, float, float]:
    """bench_rebuild's log of ``entries``: (decode + fold, decode only, msgspec's decode alone),
    cpu seconds, best of 3. Decode only is the codec's ``decode_envelope``; msgspec alone is
    its one ``Decoder(Envelope).decode`` without the codec's checks: the floor of any decoding."""
    import msgspec

    from bench_rebuild import cloned_log
    from gpupool.events import decode_envelope
    from gpupool.runtime.projection import metrics_projection

    encoded, _, _ = cloned_log(entries)

    def best(work: Callable[[], object]) -> float:
        times = []
        for _ in range(3):
            started = time.process_time()
            work()
            times.append(time.process_time() - started)
        return min(times)

    def rebuild() -> None:
        projection = metrics_projection()
        apply = projection.apply
        for seq, data in enumerate(encoded, start=1):
            apply(seq, decode_envelope(data))

    def decode_only() -> None:
        for data in encoded:
            decode_envelope(data)

    plain = msgspec.json.Decoder(Envelope)

    def msgspec_only() -> None:
        for data in encoded:
            plain.decode(data)

    return best(rebuild), best(decode_only), best(msgspec_only)


def preemption_state(nodes: int) -> State:
    state = State()
    qos = QosConfig(preempt_enabled=True, pod_max_duration_minutes=60)
    for n in range(nodes):
        node = f"node-{n:04d}"
        events: list[Event] = [
            GpuInventoryReported(
                node=node,
                gpus=tuple(GpuInfo(index=i, uuid=f"G-{node}-{i}", memory_mib=1) for i in range(8)),
                source="simulated",
            ),
            NodeConfigured(node=node, policy="share-pool", qos=qos, gpu_count=8),
        ]
        for i in range(16):
            pod = PodRef(namespace="bench", name=f"{node}-{i}")
            events += [registration(pod, node, 50), PodReady(pod=pod, node=node)]
            if i < 15:
                events.append(
                    Assigned(pod=pod, node=node, gpu_index=i // 2, gpu_uuid=f"G-{node}-{i // 2}")
                )
        for index, event in enumerate(events):
            evolve(state, Envelope(id=f"{node}-{index}", time=NOW, event=event))
    return state


def incremental_pass(state: State) -> Callable[[], object]:
    """What the preemption service does now after an event: update the one node it touched."""
    now = NOW + timedelta(minutes=1)
    deadlines = PreemptionDeadlines()
    for node in state.nodes:
        deadlines.update(state, node, now)
    touched = next(iter(state.nodes))

    def run() -> object:
        deadlines.update(state, touched, now)
        return deadlines.earliest()

    return run


def timer_pass(state: State) -> Callable[[], object]:
    now = NOW + timedelta(minutes=1)

    def run() -> object:
        return {
            node: when
            for node in state.nodes
            if (when := next_preemption_check(state, node, now)) is not None
        }

    return run


async def main(
    burst_size: int,
    latency_rounds: int,
    sim_pods: int,
    rebuild_entries: int,
    log_only: bool,
    cpu_only: bool,
    latency_only: bool = False,
    observer_process: bool = True,
    split: bool = False,
    pause_s: float = QUIET_S,
) -> None:
    if not cpu_only:
        await main_with_nats(
            burst_size,
            latency_rounds,
            latency_only=latency_only,
            observer_process=observer_process,
            split=split,
            pause_s=pause_s,
        )
    if log_only or latency_only:
        return
    print("## The pure-CPU rows (one process, cpu seconds)\n")
    print("| row | figure | raw baseline (same run) | ratio | goal |")
    print("|---|---|---|---|---|")
    core = {}
    for waiting in (100, 1000, 10_000):
        state = build_state(waiting)
        node = next(iter(state.nodes))
        core[waiting] = rate(lambda s=state, n=node: decide(s, Schedule(node=n), NOW))  # type: ignore[misc]
    bursts_core = {n: core_burst(n) for n in (100, 1000, 3000)}
    timers = {}
    for nodes in (1, 16, 256, 1024):
        state = preemption_state(nodes)
        every_node = 1.0 / rate(timer_pass(state))
        incremental = (
            every_node if PreemptionDeadlines is None else 1.0 / rate(incremental_pass(state))
        )
        timers[nodes] = (incremental, every_node)

    sim_events, sim_cpu = simulated(sim_pods)
    rebuild_s, decode_s, msgspec_s = rebuild_in_memory(rebuild_entries)
    for waiting, per_second in core.items():
        print(
            f"| core Schedule, {waiting:,} waiting (head blocked) | {per_second:,.0f} decisions/cpu-s "
            f"({1e6 / per_second:.1f} us) | - | - | >= 200,000/s |"
        )
    for pods, seconds in bursts_core.items():
        print(
            f"| core burst of {pods:,} PodReady (fold + Schedule each) | {seconds:.2f} s, "
            f"{seconds / pods * 1e6:.0f} us per event | - | - | linear in N |"
        )
    for nodes, (seconds, every_node) in timers.items():
        print(
            f"| preemption timer pass after an event, {nodes} node(s) | {seconds * ms:.4f} ms | "
            f"every node recomputed (before): {every_node * ms:.3f} ms | "
            f"{seconds / every_node:.3f} | independent of the node count |"
        )
    print(
        f"| rebuild from zero, {rebuild_entries:,} entries in memory (decode + fold) | "
        f"{rebuild_entries / rebuild_s:,.0f} entries/cpu-s | decode only "
        f"{rebuild_entries / decode_s:,.0f}/cpu-s; msgspec's decode alone "
        f"{rebuild_entries / msgspec_s:,.0f}/cpu-s | {decode_s / rebuild_s:.0%} / "
        f"{msgspec_s / rebuild_s:.0%} of them | "
        ">= 80 % of raw replay (bench_rebuild.py: against JetStream) |"
    )
    print(
        f"| gpupool simulate, 16 x 16 GPUs, {sim_pods:,} pods, {2 * sim_pods:,} actions | "
        f"{sim_events / sim_cpu:,.0f} events per CPU-second ({sim_events:,} events) | - | - | "
        ">= 50,000 events/s |"
    )


async def main_with_nats(
    burst_size: int,
    latency_rounds: int,
    *,
    latency_only: bool = False,
    observer_process: bool = True,
    split: bool = False,
    pause_s: float = QUIET_S,
) -> None:
    """The rows that need a nats-server: latency and bursts through the services' own code."""
    stamps = Stamps() if split else None
    bursts: dict[int, tuple[float, int]] = {}
    separate: dict[int, tuple[float, int]] = {}
    ceilings: list[float] = []
    with tempfile.TemporaryDirectory(prefix="gpupool-bench-") as tmp:
        async with run_nats_server(Path(tmp)) as url:
            server = Server(url)
            samples, arrivals, acked, baseline = await latency(
                server,
                latency_rounds,
                observer_process=observer_process,
                stamps=stamps,
                pause_s=pause_s,
            )
            await server.close()
            if not latency_only:
                ceilings.append(await raw_publish_async(url, burst_size))
                for nodes in (1, 16, 256, 1024):
                    bursts[nodes] = await burst(server, burst_size, nodes)
                    separate[nodes] = await burst(server, burst_size, nodes, separate=Path(tmp))
                ceilings.append(await raw_publish_async(url, burst_size))
    if stamps is not None:
        print("## Where a decision's time goes (--split: ms after the PodReady's ack arrived)\n")
        print("| point | median | p10 | p90 | rounds |")
        print("|---|---|---|---|---|")
        for point, median, p10, p90, count in stamps.table():
            print(f"| {point} | {median:.3f} | {p10:.3f} | {p90:.3f} | {count} |")
        print()
    raw50, raw99 = percentile(baseline, 0.5), percentile(baseline, 0.99)
    lat50, lat99 = percentile(samples, 0.5), percentile(samples, 0.99)
    where = "another process" if observer_process else "this process"
    print("## The decision-speed table (one run; baselines measured in it)\n")
    print("| row | figure | raw baseline (same run) | ratio | goal |")
    print("|---|---|---|---|---|")
    print(
        f"| PodReady stored -> Assigned stored (the server's store times), p50 / p99 "
        f"({len(samples)} pods; observer in {where}) | {lat50 * ms:.2f} / {lat99 * ms:.2f} ms | publish -> consume, interleaved "
        f"{raw50 * ms:.2f} / {raw99 * ms:.2f} ms | {lat50 / raw50:.2f}x / {lat99 / raw99:.2f}x | "
        "p50 <= 1.5x, p99 <= 2x |"
    )
    arr50, arr99 = percentile(arrivals, 0.5), percentile(arrivals, 0.99)
    print(
        f"| ... both arrivals at the observer (its wake-up for the PodReady, which the "
        f"decision's process and the server contend with, reads it low) | "
        f"{arr50 * ms:.2f} / {arr99 * ms:.2f} ms | the same | "
        f"{arr50 / raw50:.2f}x / {arr99 / raw99:.2f}x | |"
    )
    ack50, ack99 = percentile(acked, 0.5), percentile(acked, 0.99)
    print(
        f"| ... from the PodReady's PubAck in this process (the row before 2026-12-02 #12; "
        f"reads low where the decision runs before this process takes the PubAck) | "
        f"{ack50 * ms:.2f} / {ack99 * ms:.2f} ms | the same | "
        f"{ack50 / raw50:.2f}x / {ack99 / raw99:.2f}x | |"
    )
    if latency_only:
        return
    ceiling = statistics.fmean(ceilings)
    spread = (
        f"publish_async {ceiling:,.0f} msgs/s (before {ceilings[0]:,.0f}, after {ceilings[1]:,.0f})"
    )
    for name, rows in (("", bursts), (", PodReady from another process", separate)):
        for nodes, (per_second, conflicts) in rows.items():
            print(
                f"| burst of {burst_size} PodReady, one admission-queue, {nodes} node(s){name} | "
                f"{per_second:,.0f} placements/s ({conflicts} conflicts) | {spread} | "
                f"{per_second / ceiling:.2f} of it | >= 10,000/s and >= 0.33 |"
            )
    print(
        f"\nraw latency samples: mean {statistics.fmean(baseline) * ms:.2f} ms; decision path mean "
        f"{statistics.fmean(samples) * ms:.2f} ms\n"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--burst", type=int, default=2000)
    parser.add_argument("--latency", type=int, default=300)
    parser.add_argument(
        "--simulate", type=int, default=10_000, help="pods of the simulator row (2 actions each)"
    )
    parser.add_argument("--rebuild", type=int, default=100_000, help="entries of the rebuild row")
    parser.add_argument(
        "--log-only", action="store_true", help="only the rows through the log (latency, bursts)"
    )
    parser.add_argument(
        "--cpu-only", action="store_true", help="only the pure-CPU rows (no nats-server)"
    )
    parser.add_argument(
        "--latency-only", action="store_true", help="only the PodReady -> Assigned latency row"
    )
    parser.add_argument(
        "--observer",
        choices=("process", "in-process"),
        default="process",
        help="where the latency row's ordered consumers run (default: another process)",
    )
    parser.add_argument(
        "--split",
        action="store_true",
        help="stamp the points of each decision of the latency row and print their medians",
    )
    parser.add_argument(
        "--pause-ms",
        type=float,
        default=QUIET_S * 1000,
        help="the latency row's idle pause before each sample (0: back to back)",
    )
    options = parser.parse_args()
    asyncio.run(
        main(
            options.burst,
            options.latency,
            options.simulate,
            options.rebuild,
            options.log_only,
            options.cpu_only,
            latency_only=options.latency_only,
            observer_process=options.observer == "process",
            split=options.split,
            pause_s=options.pause_ms / 1000,
        )
    )
