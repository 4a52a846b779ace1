"""The composition root shared by the services: settings, wiring, graceful SIGTERM.

A service is a small object with ``start`` (after the rebuild: reconcile, start
timers) and ``react`` (after each new event). ``serve`` owns every resource in an
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
from typing import Protocol

import msgspec
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric

from gpupool.eventlog.jetstream import JetStreamEventLog
from gpupool.eventlog.port import StoredEvent
from gpupool.observability.projection import Projection
from gpupool.runtime.decider import DeciderLoop
from gpupool.runtime.http import HttpEndpoint

log = logging.getLogger(__name__)


class ServiceOptions(msgspec.Struct, kw_only=True):
    nats_url: str
    http_host: str
    http_port: int
    stream: str
    instance: str


def add_common_arguments(parser: argparse.ArgumentParser, *, default_port: int) -> None:
    env = os.environ.get
    parser.add_argument(
        "--nats",
        default=env("GPUPOOL_NATS_URL", "nats://127.0.0.1:4222"),
        help="NATS server URL (env GPUPOOL_NATS_URL)",
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
        help="this replica's name: its durable consumer is <service>-<instance>",
    )
    parser.add_argument("--log-level", default=env("GPUPOOL_LOG_LEVEL", "INFO"))


def common_options(args: argparse.Namespace) -> ServiceOptions:
    return ServiceOptions(
        nats_url=args.nats,
        http_host=args.http_host,
        http_port=args.http_port,
        stream=args.stream,
        instance=args.instance,
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
    projection: Projection | None = None,
    on_listening: Callable[[int], Awaitable[None]] | None = None,
) -> None:
    async with AsyncExitStack() as stack:
        event_log = await JetStreamEventLog.connect(options.nats_url, stream=options.stream)
        stack.push_async_callback(event_log.close)
        loop = DeciderLoop(event_log, service=service.name, projection=projection)
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
        log.info(
            "%s: rebuilt from %d log entries (last sequence %d)",
            service.name,
            folded,
            loop.projection.last_seq,
        )
        await service.start(loop, stack)
        consumer = asyncio.create_task(
            loop.consume(f"{service.name}-{options.instance}", service.react)
        )
        stopping = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({consumer, stopping}, return_when=asyncio.FIRST_COMPLETED)
        for task in (consumer, stopping):
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
        if consumer in done and consumer.exception() is not None:
            raise consumer.exception()  # type: ignore[misc]
        log.info("%s: stopped", service.name)


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
