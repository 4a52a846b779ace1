"""The composition root shared by the services: settings, wiring, graceful SIGTERM.

A service is a small object with ``start`` (after the rebuild: reconcile, start
timers) and ``react`` (after each new event), or, if it has one, ``react_batch``
(once per batch of new events the consumer folded together). ``serve`` owns every resource in an
AsyncExitStack; SIGTERM or SIGINT sets an event and the service drains: the
consumer stops, in-flight work finishes, connections close.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack, suppress
from pathlib import Path
from typing import Any, Protocol

import msgspec
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric

from gpupool.eventlog.durables import durable_base
from gpupool.eventlog.jetstream import JetStreamEventLog
from gpupool.eventlog.port import StoredEvent
from gpupool.events import NODELESS
from gpupool.runtime.decider import DeciderLoop
from gpupool.runtime.heap import settle_after_rebuild
from gpupool.runtime.http import HttpEndpoint
from gpupool.runtime.partition import restrict_to_node
from gpupool.runtime.projection import Projection
from gpupool.runtime.snapshot_store import (
    FileSnapshotStore,
    load_projection,
    save_projection,
)

log = logging.getLogger(__name__)


class LogPurgedPastSnapshot(RuntimeError):
    """The stream was purged past what the service's snapshot covers: it cannot rebuild."""


class ServiceOptions(msgspec.Struct, kw_only=True):
    nats_url: str
    http_host: str
    http_port: int
    stream: str
    instance: str
    snapshot_dir: Path | None = None
    snapshot_every: int = 10_000
    nats_credentials: Path | None = None
    """This service's NATS credential (an nkey seed file); None: an unauthenticated server."""
    nats_ca: Path | None = None
    """The CA that signed the NATS server's certificate (TLS); None: the system's, or plain."""


def add_common_arguments(parser: argparse.ArgumentParser, *, default_port: int) -> None:
    env = os.environ.get
    parser.add_argument(
        "--nats",
        default=env("GPUPOOL_NATS_URL", "nats://127.0.0.1:4222"),
        help="NATS server URL (env GPUPOOL_NATS_URL)",
    )
    parser.add_argument(
        "--nats-credentials",
        type=Path,
        default=env("GPUPOOL_NATS_CREDENTIALS") or None,
        metavar="FILE",
        help="this service's NATS credential: the nkey seed file `gpupool credentials "
        "generate` wrote for it, or a .creds file (env GPUPOOL_NATS_CREDENTIALS; "
        "default: none, for a local server without authentication)",
    )
    parser.add_argument(
        "--nats-ca",
        type=Path,
        default=env("GPUPOOL_NATS_CA") or None,
        metavar="FILE",
        help="PEM of the CA that signed the NATS server's certificate (env GPUPOOL_NATS_CA)",
    )
    parser.add_argument(
        "--http-host",
        default=env("GPUPOOL_HTTP_HOST", "127.0.0.1"),
        help="address of /healthz, /readyz, /metrics (env GPUPOOL_HTTP_HOST)",
    )
    parser.add_argument(
        "--http-port",
        type=int,
        default=int(env("GPUPOOL_HTTP_PORT", str(default_port))),
        help="port of /healthz, /readyz, /metrics (env GPUPOOL_HTTP_PORT; 0: any)",
    )
    parser.add_argument(
        "--stream",
        default=env("GPUPOOL_STREAM", "GPUPOOL"),
        help="JetStream stream holding the log (env GPUPOOL_STREAM)",
    )
    parser.add_argument(
        "--instance",
        default=env("GPUPOOL_INSTANCE", socket.gethostname()),
        help="this replica's name (unique among the service's replicas): it claims one of "
        "its NATS user's durable consumers <user>-0 … <user>-7 under this name (kept in the "
        "consumer's metadata), resumes that one after a restart, and names its snapshot "
        "<service>-<instance>.snapshot",
    )
    parser.add_argument(
        "--snapshot-dir",
        type=Path,
        default=env("GPUPOOL_SNAPSHOT_DIR"),
        help="keep a snapshot of the projection here; a restart resumes from it "
        "instead of replaying the whole log (env GPUPOOL_SNAPSHOT_DIR)",
    )
    parser.add_argument(
        "--snapshot-every",
        type=int,
        default=10_000,
        metavar="N",
        help="save a snapshot after every N new log entries (and on stop)",
    )
    parser.add_argument("--log-level", default=env("GPUPOOL_LOG_LEVEL", "INFO"))


def common_options(args: argparse.Namespace) -> ServiceOptions:
    return ServiceOptions(
        nats_url=args.nats,
        http_host=args.http_host,
        http_port=args.http_port,
        stream=args.stream,
        instance=args.instance,
        snapshot_dir=Path(args.snapshot_dir) if args.snapshot_dir else None,
        snapshot_every=args.snapshot_every,
        nats_credentials=args.nats_credentials,
        nats_ca=args.nats_ca,
    )


class Service(Protocol):
    name: str

    async def start(self, loop: DeciderLoop, stack: AsyncExitStack) -> None: ...

    async def react(self, entry: StoredEvent) -> None: ...


class _LoopCollector:
    """Service-level figures (not projections of the log): readiness, conflicts, garbage seen."""

    def __init__(self, service: str, loop: DeciderLoop) -> None:
        self.service = service
        self.loop = loop

    def collect(self) -> list[Metric]:
        ready = GaugeMetricFamily(
            "gpupool_service_ready", "1 when rebuilt and consuming", labels=["service"]
        )
        ready.add_metric([self.service], 1.0 if self.loop.ready else 0.0)
        conflicts = GaugeMetricFamily(
            "gpupool_service_append_conflicts",
            "appends refused by optimistic concurrency since start",
            labels=["service"],
        )
        conflicts.add_metric([self.service], float(self.loop.conflicts))
        applied = GaugeMetricFamily(
            "gpupool_service_applied_sequence", "last log sequence folded", labels=["service"]
        )
        applied.add_metric([self.service], float(self.loop.projection.last_seq))
        return [ready, conflicts, applied]


async def run_service(
    service: Service,
    options: ServiceOptions,
    stop: asyncio.Event,
    *,
    registry_factory: Callable[[Projection], CollectorRegistry] | None = None,
    projection_factory: Callable[[], Projection] = Projection,
    on_listening: Callable[[int], Awaitable[None]] | None = None,
    partition: str | None = None,
) -> None:
    """Run ``service`` until ``stop``; with ``partition`` (a node) it reads only that node's
    entries (the node-executor: docs/eventlog.md, "A node's partition")."""
    async with AsyncExitStack() as stack:
        event_log = await JetStreamEventLog.connect(
            options.nats_url,
            stream=options.stream,
            name=service.name,
            writer=service.name,
            credentials=options.nats_credentials,
            tls_ca=options.nats_ca,
            claimant=options.instance,
            # with credentials: read only through the user's own consumers (no other's)
            consumer_base=None
            if options.nats_credentials is None
            else durable_base(service.name, getattr(service, "node", None)),
        )
        stack.push_async_callback(event_log.close)
        snapshots: FileSnapshotStore | None = None
        if options.snapshot_dir is not None:
            options.snapshot_dir.mkdir(parents=True, exist_ok=True)
            snapshots = FileSnapshotStore(
                options.snapshot_dir / f"{service.name}-{options.instance}.snapshot"
            )
            projection, why = await load_projection(snapshots, empty=projection_factory)
            log.info("%s: %s", service.name, why)
            end = await event_log.last_seq()
            if projection.last_seq > end:  # the stream was recreated: the snapshot is of another
                log.warning(
                    "%s: the snapshot covers sequence %d but the log ends at %d; "
                    "rebuilding from the start of the log",
                    service.name,
                    projection.last_seq,
                    end,
                )
                projection = projection_factory()
            elif partition is not None and (others := _other_nodes(projection, partition)):
                # a whole-log fold (an archive's checkpoint, a snapshot from before the
                # partition): its node's part is what this reader would have folded
                log.info(
                    "%s: the snapshot holds other nodes than %s too (%s); keeping %s's part",
                    service.name,
                    partition,
                    ", ".join(sorted(others)[:3]),
                    partition,
                )
                restricted = restrict_to_node(projection, partition)
                restricted.observers = projection.observers
                projection = restricted
        else:
            projection = projection_factory()
        first = await event_log.first_seq()
        if first > projection.last_seq + 1:
            where = (
                str(snapshots.path)
                if snapshots is not None
                else "<snapshot-dir>/<service>-<instance>.snapshot (and set --snapshot-dir)"
            )
            raise LogPurgedPastSnapshot(
                f"{service.name}: the log starts at sequence {first} (entries before it were "
                f"purged) but this service's state covers only up to {projection.last_seq}: "
                f"a rebuild would miss them. Start it from the archive's checkpoint: copy "
                f"checkpoint-<N>.snapshot (N >= {first - 1}) to {where}"
            )
        loop = DeciderLoop(
            event_log, service=service.name, projection=projection, partition=partition
        )
        registry = (
            registry_factory(loop.projection)
            if registry_factory is not None
            else CollectorRegistry()
        )
        registry.register(_LoopCollector(service.name, loop))
        endpoint = HttpEndpoint(registry=registry, is_ready=lambda: loop.ready)
        port = await endpoint.start(options.http_host, options.http_port)
        stack.push_async_callback(endpoint.stop)
        log.info(
            "%s: http on %s:%d; rebuilding from %s",
            service.name,
            options.http_host,
            port,
            options.nats_url,
        )
        if on_listening is not None:
            await on_listening(port)
        folded = await loop.rebuild()
        settle_after_rebuild()
        log.info(
            "%s: rebuilt from %d log entries (last sequence %d)",
            service.name,
            folded,
            loop.projection.last_seq,
        )
        await service.start(loop, stack)
        consumer = asyncio.create_task(
            loop.consume(
                # one of the user's durables <user>-0 … -7, claimed for this instance
                durable_base(service.name, getattr(service, "node", None)),
                service.react,
                react_batch=getattr(service, "react_batch", None),
                ack_before_reacting=getattr(service, "ack_before_reacting", False),
                react_on_arrival=getattr(service, "react_on_arrival", False),
            )
        )
        if snapshots is not None:
            store = snapshots
            saver = loop.background(
                _keep_snapshots(store, loop, options.snapshot_every), name="snapshots"
            )

            async def final_snapshot() -> None:
                saver.cancel()
                with suppress(asyncio.CancelledError):
                    await saver
                covered = await save_projection(store, loop.projection)
                log.info("%s: snapshot saved, covering sequence %d", service.name, covered)

            stack.push_async_callback(final_snapshot)
        stopping = asyncio.create_task(stop.wait())
        failing = asyncio.create_task(loop.failed.wait())
        await asyncio.wait({consumer, stopping, failing}, return_when=asyncio.FIRST_COMPLETED)
        for task in (consumer, stopping, failing):
            await _cancelled(task)
            with suppress(asyncio.CancelledError):
                await task  # re-raises what ended the consumer, if anything did
        if loop.failure is not None:
            raise RuntimeError(f"{service.name}: a background task failed") from loop.failure
        log.info("%s: stopped", service.name)


SNAPSHOT_CHECK_SECONDS = 5.0

CANCEL_AGAIN_SECONDS = 1.0
"""How long a cancelled task may take to end before it is cancelled again."""


async def _cancelled(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` until it has ended. One cancellation can be lost: on Python 3.11 the
    ``asyncio.wait_for`` inside nats-py's requests swallows a cancellation that arrives as
    the reply does (a service stopped while its consumer was claiming its durable then
    waited for deliveries for ever)."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=CANCEL_AGAIN_SECONDS)


def _other_nodes(projection: Projection, node: str) -> set[str]:
    """The nodes besides ``node`` (and no node) whose state ``projection`` holds."""
    state = projection.state
    named = set(state.nodes) | {pod.node for pod in state.pods.values()}
    return named - {node, NODELESS}


async def _keep_snapshots(store: FileSnapshotStore, loop: DeciderLoop, every: int) -> None:
    """Save a snapshot whenever ``every`` new entries were folded since the last one."""
    saved = loop.projection.last_seq
    while True:
        await asyncio.sleep(SNAPSHOT_CHECK_SECONDS)  # a periodic job: nothing to wait on
        try:
            await loop.keep_up()  # a quiet node's partition: its watermark reaches the log's end
        except Exception:  # a busy or reconnecting server: the next round tries again
            log.warning("%s: keeping the watermark up failed", loop.service, exc_info=True)
        if loop.projection.last_seq - saved >= every:
            saved = await save_projection(store, loop.projection)


def serve(main: Callable[[asyncio.Event], Awaitable[None]], *, log_level: str = "INFO") -> None:
    """Run ``main`` until it returns or SIGTERM/SIGINT arrives (then ``main``'s stop event is set)."""
    logging.basicConfig(
        level=log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    asyncio.run(runner())
