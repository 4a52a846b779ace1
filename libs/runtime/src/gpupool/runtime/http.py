"""A small HTTP endpoint on asyncio: /healthz, /readyz, /metrics and any routes a service adds.

Only what a probe, a Prometheus scrape or a scheduler-extender call needs:
HTTP/1.1, one request per connection, Content-Length bodies.

Bounded against hostile clients (docs/security.md): a line of at most
:data:`MAX_LINE_BYTES`, at most :data:`MAX_HEADER_BYTES` of request line and
headers (431), a body only where the route takes one and of at most its
``max_body`` (413, refused before a byte of it is read), no chunked bodies (411),
at most :data:`MAX_CONNECTIONS` connections at once (503 to the next ones, at
once), the whole request within ``request_timeout_seconds`` (408: idle and slow
clients), and the answer written within :data:`WRITE_TIMEOUT_SECONDS` (a client
that does not read is dropped).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Any

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
    411: "Length Required",
    413: "Payload Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}
MAX_BODY = 4 * 1024 * 1024
"""The largest body a route that takes one accepts by default (an AdmissionReview of a large pod
with its old object, an extender call with every candidate node, fit with room to spare)."""
MAX_LINE_BYTES = 8 * 1024
MAX_HEADER_BYTES = 32 * 1024
"""Request line and headers together."""
MAX_CONNECTIONS = 64
"""Connections served at once; the next ones are answered 503 and closed without being read."""
REQUEST_TIMEOUT_SECONDS = 10.0
"""A client must send its whole request (line, headers, body) within this time."""
WRITE_TIMEOUT_SECONDS = 10.0


class HttpEndpoint:
    def __init__(
        self,
        *,
        registry: CollectorRegistry | None = None,
        is_ready: Callable[[], bool] = lambda: True,
        request_timeout_seconds: float = REQUEST_TIMEOUT_SECONDS,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.routes: dict[tuple[str, str], Handler] = {}
        self.max_body: dict[tuple[str, str], int] = {}
        self.request_timeout = request_timeout_seconds
        self.max_connections = max_connections
        self.connections = 0
        self.refused_connections = 0
        """Connections answered 503 because ``max_connections`` were being served."""
        self.registry = registry
        self._is_ready = is_ready
        self._server: asyncio.Server | None = None
        self.add("GET", "/healthz", self._healthz)
        self.add("GET", "/readyz", self._readyz)
        self.add("GET", "/metrics", self._metrics)

    def add(self, method: str, path: str, handler: Handler, *, max_body: int | None = None) -> None:
        """Route ``method path`` to ``handler``; its body may be up to ``max_body`` bytes
        (default: none for GET, :data:`MAX_BODY` otherwise)."""
        self.routes[(method, path)] = handler
        self.max_body[(method, path)] = (
            max_body if max_body is not None else (0 if method == "GET" else MAX_BODY)
        )

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
        return await self._listen(host, port)

    async def _listen(self, host: str, port: int, ssl: Any = None) -> int:
        self._server = await asyncio.start_server(
            self._accept, host, port, ssl=ssl, limit=MAX_LINE_BYTES
        )
        bound: int = self._server.sockets[0].getsockname()[1]
        return bound

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.connections >= self.max_connections:
            self.refused_connections += 1
            await self._answer(writer, (503, "text/plain", b"too many connections\n"))
            return
        self.connections += 1
        try:
            await self._serve(reader, writer)
        finally:
            self.connections -= 1

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with suppress(Exception):
                await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            response = await self._respond(reader)
        except asyncio.LimitOverrunError:
            response = 431, "text/plain", b"request line or header too long\n"
        except (asyncio.IncompleteReadError, ConnectionError, ValueError) as exc:
            if isinstance(exc.__context__, asyncio.LimitOverrunError):
                response = 431, "text/plain", b"request line or header too long\n"
            else:
                response = 400, "text/plain", b"bad request\n"
        except Exception:
            log.exception("HTTP handler failed")
            response = 500, "text/plain", b"internal error\n"
        await self._answer(writer, response)

    async def _answer(self, writer: asyncio.StreamWriter, response: Response) -> None:
        status, content_type, body = response
        head = (
            f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        )
        try:
            async with asyncio.timeout(WRITE_TIMEOUT_SECONDS):
                writer.write(head.encode() + body)
                await writer.drain()
        except (ConnectionError, TimeoutError):
            writer.transport.abort()  # a client that does not read its answer is dropped
        writer.close()
        with suppress(ConnectionError, TimeoutError):
            async with asyncio.timeout(WRITE_TIMEOUT_SECONDS):
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
                header_bytes = len(request_line)
                while True:
                    line = (await reader.readline()).decode("latin-1")
                    header_bytes += len(line)
                    if header_bytes > MAX_HEADER_BYTES:
                        return 431, "text/plain", b"request headers too large\n"
                    if line in ("\r\n", "\n", ""):
                        break
                    name, _, value = line.partition(":")
                    name = name.strip().lower()
                    if name == "content-length":
                        length = int(value.strip())
                        if length < 0:
                            return 400, "text/plain", b"bad content-length\n"
                    elif name == "transfer-encoding":
                        return 411, "text/plain", b"a body must come with a content-length\n"
                path = target.split("?", 1)[0]
                handler = self.routes.get((method, path))
                if handler is None:  # answered without reading a body
                    if any(p == path for _, p in self.routes):
                        return 405, "text/plain", b"method not allowed\n"
                    return 404, "text/plain", b"not found\n"
                limit = self.max_body[(method, path)]
                if length > limit:
                    # refused before a byte of it is read
                    return 413, "text/plain", f"body too large (at most {limit} bytes)\n".encode()
                body = await reader.readexactly(length) if length else b""
        except TimeoutError:
            return 408, "text/plain", b"request timeout\n"
        return await handler(body)
