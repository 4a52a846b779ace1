"""A small HTTP endpoint on asyncio: /healthz, /readyz, /metrics and any routes a service adds.

Only what a probe, a Prometheus scrape or a scheduler-extender call needs:
HTTP/1.1, one request per connection, Content-Length bodies.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextlib import suppress

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

log = logging.getLogger(__name__)

Response = tuple[int, str, bytes]
Handler = Callable[[bytes], Awaitable[Response]]

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    413: "Payload Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}
MAX_BODY = 16 * 1024 * 1024
REQUEST_TIMEOUT_SECONDS = 10.0
"""A client must send its whole request (line, headers, body) within this time."""


class HttpEndpoint:
    def __init__(
        self,
        *,
        registry: CollectorRegistry | None = None,
        is_ready: Callable[[], bool] = lambda: True,
        request_timeout_seconds: float = REQUEST_TIMEOUT_SECONDS,
    ) -> None:
        self.routes: dict[tuple[str, str], Handler] = {}
        self.request_timeout = request_timeout_seconds
        self.registry = registry
        self._is_ready = is_ready
        self._server: asyncio.Server | None = None
        self.add("GET", "/healthz", self._healthz)
        self.add("GET", "/readyz", self._readyz)
        self.add("GET", "/metrics", self._metrics)

    def add(self, method: str, path: str, handler: Handler) -> None:
        self.routes[(method, path)] = handler

    async def _healthz(self, _: bytes) -> Response:
        return 200, "text/plain", b"ok\n"

    async def _readyz(self, _: bytes) -> Response:
        if self._is_ready():
            return 200, "text/plain", b"ready\n"
        return 503, "text/plain", b"not ready: rebuilding from the log\n"

    async def _metrics(self, _: bytes) -> Response:
        if self.registry is None:
            return 404, "text/plain", b"no metrics here\n"
        return 200, CONTENT_TYPE_LATEST, generate_latest(self.registry)

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._serve, host, port)
        bound: int = self._server.sockets[0].getsockname()[1]
        return bound

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with suppress(Exception):
                await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            status, content_type, body = await self._respond(reader)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            status, content_type, body = 400, "text/plain", b"bad request\n"
        except Exception:
            log.exception("HTTP handler failed")
            status, content_type, body = 500, "text/plain", b"internal error\n"
        head = (
            f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        )
        with suppress(ConnectionError):
            writer.write(head.encode() + body)
            await writer.drain()
        writer.close()
        with suppress(ConnectionError):
            await writer.wait_closed()

    async def _respond(self, reader: asyncio.StreamReader) -> Response:
        try:
            # a client that never finishes its request must not hold the connection forever
            async with asyncio.timeout(self.request_timeout):
                request_line = (await reader.readline()).decode("latin-1").strip()
                parts = request_line.split(" ")
                if len(parts) != 3:
                    return 400, "text/plain", b"bad request line\n"
                method, target, _ = parts
                length = 0
                while True:
                    line = (await reader.readline()).decode("latin-1")
                    if line in ("\r\n", "\n", ""):
                        break
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value.strip())
                if length > MAX_BODY:
                    return 413, "text/plain", b"body too large\n"
                body = await reader.readexactly(length) if length else b""
        except TimeoutError:
            return 408, "text/plain", b"request timeout\n"
        path = target.split("?", 1)[0]
        handler = self.routes.get((method, path))
        if handler is None:
            if any(p == path for _, p in self.routes):
                return 405, "text/plain", b"method not allowed\n"
            return 404, "text/plain", b"not found\n"
        return await handler(body)
