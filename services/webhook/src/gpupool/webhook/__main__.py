"""python -m gpupool.webhook --tls-cert tls.crt --tls-key tls.key [--http-port 9443]

The mutating admission webhook: the API server POSTs AdmissionReview v1 to /mutate over HTTPS;
GPU-sharing pods get the CUDA hook (or are denied with the core's reason when their share spec
is invalid). /healthz and /readyz answer on the same HTTPS port.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import ssl
from collections import Counter

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric

from gpupool.runtime.http import HttpEndpoint, Response
from gpupool.runtime.service import serve
from gpupool.webhook.review import BadReview, HookSettings, review

log = logging.getLogger("gpupool.webhook")


class HttpsEndpoint(HttpEndpoint):
    """The runtime's HTTP endpoint, served over TLS (the API server calls webhooks by HTTPS)."""

    def __init__(self, context: ssl.SSLContext, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._context = context

    async def start(self, host: str, port: int) -> int:
        return await self._listen(host, port, ssl=self._context)


class WebhookHandlers:
    def __init__(self, settings: HookSettings) -> None:
        self._settings = settings
        self.answered: Counter[str] = Counter()

    async def mutate(self, body: bytes) -> Response:
        try:
            answer = review(body, self._settings)
        except BadReview as error:
            self.answered["bad-request"] += 1
            log.warning("webhook: bad request: %s", error)
            return 400, "text/plain", f"{error}\n".encode()
        self.answered["ok"] += 1
        return 200, "application/json", answer

    def collect(self) -> list[Metric]:
        answered = CounterMetricFamily(
            "gpupool_webhook_reviews", "AdmissionReviews answered, by outcome", labels=["outcome"]
        )
        for outcome, count in sorted(self.answered.items()):
            answered.add_metric([outcome], float(count))
        return [answered]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    defaults = HookSettings()
    parser = argparse.ArgumentParser(
        prog="python -m gpupool.webhook",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--http-host", default=env("GPUPOOL_HTTP_HOST", "0.0.0.0"))
    parser.add_argument("--http-port", type=int, default=int(env("GPUPOOL_HTTP_PORT", "9443")))
    parser.add_argument("--tls-cert", required=True, help="PEM certificate (chain) to serve")
    parser.add_argument("--tls-key", required=True, help="PEM private key of the certificate")
    parser.add_argument("--hook-host-dir", default=defaults.hook_host_dir)
    parser.add_argument("--socket-host-dir", default=defaults.socket_host_dir)
    parser.add_argument("--socket-group", type=int, default=defaults.socket_group)
    parser.add_argument("--log-level", default=env("GPUPOOL_LOG_LEVEL", "INFO"))
    return parser.parse_args(argv)


CERTIFICATE_CHECK_SECONDS = 30.0


def _stamp(*paths: str) -> tuple[float, ...]:
    return tuple(os.stat(path).st_mtime for path in paths)


async def reload_certificate(
    context: ssl.SSLContext, cert: str, key: str, stop: asyncio.Event
) -> None:
    """Load the certificate again when its files change (cert-manager's or a script's renewal):
    new connections get the new one, open ones keep theirs."""
    seen = _stamp(cert, key)
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CERTIFICATE_CHECK_SECONDS):
                await stop.wait()
        try:
            now = _stamp(cert, key)
            if now != seen:
                context.load_cert_chain(cert, key)
                seen = now
                log.info("gpupool-webhook: reloaded its certificate %s", cert)
        except (OSError, ssl.SSLError) as error:  # half-written during a swap: next time
            log.warning("gpupool-webhook: cannot reload its certificate yet: %s", error)


async def run(args: argparse.Namespace, stop: asyncio.Event) -> None:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(args.tls_cert, args.tls_key)
    settings = HookSettings(
        hook_host_dir=args.hook_host_dir,
        socket_host_dir=args.socket_host_dir,
        socket_group=args.socket_group,
    )
    handlers = WebhookHandlers(settings)
    registry = CollectorRegistry()
    registry.register(handlers)
    endpoint = HttpsEndpoint(context, registry=registry)
    # An AdmissionReview holds the pod (at most ~1.5 MiB in etcd), twice on an update.
    endpoint.add("POST", "/mutate", handlers.mutate, max_body=8 * 1024 * 1024)
    port = await endpoint.start(args.http_host, args.http_port)
    # the line tests and operators wait for
    log.info("gpupool-webhook listening on https://%s:%d", args.http_host, port)
    try:
        await reload_certificate(context, args.tls_cert, args.tls_key, stop)
    finally:
        await endpoint.stop()
        log.info("gpupool-webhook stopped")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)

    async def runner(stop: asyncio.Event) -> None:
        await run(args, stop)

    serve(runner, log_level=args.log_level)


if __name__ == "__main__":
    main()
