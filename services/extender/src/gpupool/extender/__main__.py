"""python -m gpupool.extender --http-port 9105 [--kubeconfig PATH | --server URL]

The scheduler extender: kube-scheduler POSTs ExtenderArgs to /filter and
/prioritize; /healthz answers while the process runs, /readyz once the node and
pod caches are listed.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from contextlib import AsyncExitStack, suppress

from prometheus_client import CollectorRegistry

from gpupool.extender.cluster_cache import ClusterCache
from gpupool.extender.service import ExtenderCollector, ExtenderHandlers
from gpupool.kube.adapter import KubernetesAsyncioApi
from gpupool.runtime.http import HttpEndpoint
from gpupool.runtime.service import serve

log = logging.getLogger("gpupool.extender")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(
        prog="python -m gpupool.extender",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--http-host",
        default=env("GPUPOOL_HTTP_HOST", "0.0.0.0"),
        help="address to listen on (env GPUPOOL_HTTP_HOST)",
    )
    parser.add_argument(
        "--http-port",
        type=int,
        default=int(env("GPUPOOL_HTTP_PORT", "9105")),
        help="port to listen on (env GPUPOOL_HTTP_PORT; 0: any free port)",
    )
    api = parser.add_mutually_exclusive_group()
    api.add_argument(
        "--kubeconfig",
        default=env("KUBECONFIG") or None,
        help="kubeconfig file (default: in-cluster service account, then ~/.kube/config)",
    )
    api.add_argument(
        "--server", default=None, help="API server URL without credentials (kubectl proxy, tests)"
    )
    parser.add_argument("--context", default=None, help="kubeconfig context")
    parser.add_argument("--log-level", default=env("GPUPOOL_LOG_LEVEL", "INFO"))
    return parser.parse_args(argv)


async def run(args: argparse.Namespace, stop: asyncio.Event) -> None:
    async with AsyncExitStack() as stack:
        api = await KubernetesAsyncioApi.connect(
            host=args.server, kubeconfig=args.kubeconfig, context=args.context
        )
        stack.push_async_callback(api.close)
        cache = ClusterCache(api)
        handlers = ExtenderHandlers(cache)
        registry = CollectorRegistry()
        registry.register(ExtenderCollector(cache, handlers))
        endpoint = HttpEndpoint(registry=registry, is_ready=lambda: cache.ready)
        handlers.install(endpoint)
        port = await endpoint.start(args.http_host, args.http_port)
        stack.push_async_callback(endpoint.stop)
        log.info("gpupool-extender listening on http://%s:%d", args.http_host, port)
        watching = asyncio.create_task(cache.run(), name="extender-cache")
        stopping = asyncio.create_task(stop.wait(), name="extender-stop")
        ready = asyncio.create_task(cache.wait_ready(), name="extender-ready")
        done, _ = await asyncio.wait(
            {watching, stopping, ready}, return_when=asyncio.FIRST_COMPLETED
        )
        if ready in done:
            log.info(
                "gpupool-extender ready: %d nodes, %d pods cached",
                len(cache.nodes),
                len(cache.pods),
            )
            await asyncio.wait({watching, stopping}, return_when=asyncio.FIRST_COMPLETED)
        for task in (watching, stopping, ready):
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
        log.info("gpupool-extender stopped")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)

    async def runner(stop: asyncio.Event) -> None:
        await run(args, stop)

    serve(runner, log_level=args.log_level)


if __name__ == "__main__":
    main()
