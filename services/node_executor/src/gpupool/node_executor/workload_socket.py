"""The node-executor's local endpoint: a Unix socket that ``gpupool run`` and the CUDA hook connect to.

Per connection: read the peer's credentials (SO_PEERCRED) and cgroup, read one request line,
then hand it and a :class:`Channel` to the :class:`WorkloadHandler`: a RunRequest comes with
the client's stdin/stdout/stderr as SCM_RIGHTS (``handle``; the fds are valid while it runs and
closed after it), an AttachRequest from the CUDA hook with none (``attach``). A bad request is
answered with ``Rejected`` and the server keeps serving.

The listener is accepted with ``loop.sock_accept`` rather than ``asyncio.start_unix_server``:
a stream transport starts reading with plain ``recv`` at once, which would drop the fds. Once
the request is in, the connection is turned into asyncio streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import Protocol

from gpupool.node_executor.peer_identity import PeerIdentity, identify_peer
from gpupool.workload import (
    MAX_REQUEST_BYTES,
    PASSED_FDS,
    AttachRequest,
    ExecutorMessage,
    Exited,
    Granted,
    ProtocolError,
    Rejected,
    RunRequest,
    StdioFds,
    decode_workload_request,
    encode_line,
)
from gpupool.workload.fd_passing import LineTooLong, receive_line_with_fds, send_with_fds

log = logging.getLogger(__name__)

SOCKET_MODE = 0o660
"""Owner and group (the pods' supplemental group, set by the deployment) may connect."""
DEFAULT_REQUEST_TIMEOUT_SECONDS = 10.0
"""A client must send its whole request line within this time after connecting."""


class Channel:
    """The executor's side of one connection: send messages, learn when the client went away."""

    def __init__(
        self,
        peer: PeerIdentity,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        connection: socket.socket | None = None,
    ) -> None:
        self.peer = peer
        self._writer = writer
        self._connection = connection
        self._gone = asyncio.Event()
        self._finished = False
        self._watch = asyncio.create_task(self._watch_for_hangup(reader))

    async def _watch_for_hangup(self, reader: asyncio.StreamReader) -> None:
        # The client sends nothing after its request: any read that returns is EOF or noise.
        with contextlib.suppress(ConnectionError):
            while await reader.read(4096):
                pass
        self._gone.set()

    @property
    def client_gone(self) -> bool:
        return self._gone.is_set()

    async def wait_client_gone(self) -> None:
        """Returns when the client disconnected (for a waiting pod: it cancelled)."""
        await self._gone.wait()

    @property
    def finished(self) -> bool:
        """Whether the last word (Exited or Rejected) was sent."""
        return self._finished

    async def send(self, message: ExecutorMessage) -> bool:
        """Send one message; False (and nothing raised) when the client is gone."""
        if self._gone.is_set() or self._writer.is_closing():
            return False
        if isinstance(message, Exited | Rejected):
            self._finished = True
        try:
            self._writer.write(encode_line(message))
            await self._writer.drain()
        except ConnectionError:
            self._gone.set()
            return False
        return True

    async def send_granted(self, message: Granted, fd: int) -> bool:
        """Send ``message`` with ``fd`` as SCM_RIGHTS; False when the client is gone.

        The stream's buffer is drained first, so the line goes out in order on the raw socket.
        """
        if self._gone.is_set() or self._writer.is_closing() or self._connection is None:
            return False
        try:
            await self._writer.drain()
            await send_with_fds(self._connection, encode_line(message), (fd,))
        except OSError:
            self._gone.set()
            return False
        return True

    async def close(self) -> None:
        self._watch.cancel()
        self._writer.close()
        with contextlib.suppress(ConnectionError):
            await self._writer.wait_closed()


RejectionRecorder = Callable[[PeerIdentity, bytes, str, str], Awaitable[None]]
"""Called for every request refused before it reached the handler: (peer, bytes, reason, message)."""


class WorkloadHandler(Protocol):
    """Runs one request: waits for a GPU, runs the command, reports through ``channel``.

    It should end with ``Exited`` or ``Rejected``; ``fds`` are closed after it returns, so a
    process that must keep them has to be given them (dup'd) before that.
    """

    async def handle(self, request: RunRequest, fds: StdioFds, channel: Channel) -> None: ...

    async def attach(self, request: AttachRequest, channel: Channel) -> None:
        """A process's CUDA hook asks for its pod's GPU; returns when the process is done."""
        ...


class WorkloadSocketServer:
    """Serves ``handler`` on the Unix socket at ``path`` until closed (an async context manager)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        handler: WorkloadHandler,
        *,
        mode: int = SOCKET_MODE,
        request_timeout_seconds: float = DEFAULT_REQUEST_TIMEOUT_SECONDS,
        on_rejected: RejectionRecorder | None = None,
    ) -> None:
        self.path = Path(path)
        self._handler = handler
        self._on_rejected = on_rejected
        self._mode = mode
        self._request_timeout = request_timeout_seconds
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        if self.path.exists() or self.path.is_symlink():
            if not stat.S_ISSOCK(self.path.lstat().st_mode):
                raise FileExistsError(f"{self.path} exists and is not a socket")
            self.path.unlink()  # a stale socket of an earlier run
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(os.fspath(self.path))
            os.chmod(self.path, self._mode)
            listener.listen(128)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self._accepting = asyncio.create_task(self._accept_forever(listener))
        log.info("serving workloads on %s", self.path)

    async def close(self) -> None:
        """Stop accepting, cancel the handlers of open connections, remove the socket file."""
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
            self._accepting = None
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    async def __aenter__(self) -> WorkloadSocketServer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    async def _accept_forever(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                connection, _ = await loop.sock_accept(listener)
            except OSError as error:  # e.g. EMFILE: log, keep serving
                log.warning("accept failed on %s: %s", self.path, error)
                continue
            task = asyncio.create_task(self._serve(connection))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _serve(self, connection: socket.socket) -> None:
        connection.setblocking(False)
        fds: list[int] = []
        try:
            peer = identify_peer(connection)
            try:
                async with asyncio.timeout(self._request_timeout):
                    line, fds = await receive_line_with_fds(connection, MAX_REQUEST_BYTES)
            except TimeoutError:
                await self._reject(
                    connection, peer, b"", "request-timeout", "no complete request in time"
                )
                return
            except LineTooLong as error:
                await self._reject(connection, peer, b"", "request-too-large", str(error))
                return
            if not line.endswith(b"\n"):
                return  # the client left before finishing its request: no one to answer
            try:
                request = decode_workload_request(line)
            except ProtocolError as error:
                await self._reject(connection, peer, line, "bad-request", str(error))
                return
            if isinstance(request, AttachRequest):
                if fds:
                    await self._reject(
                        connection,
                        peer,
                        line,
                        "bad-fds",
                        f"an AttachRequest carries no file descriptors, got {len(fds)}",
                    )
                    return
                await self._run_attach(connection, peer, request)
                return
            if len(fds) != PASSED_FDS:
                await self._reject(
                    connection,
                    peer,
                    line,
                    "bad-fds",
                    f"expected {PASSED_FDS} file descriptors (stdin, stdout, stderr), got {len(fds)}",
                )
                return
            await self._run_handler(connection, peer, request, (fds[0], fds[1], fds[2]))
        except OSError as error:
            log.info("workload connection failed: %s", error)
        finally:
            for fd in fds:
                os.close(fd)
            connection.close()

    async def _reject(
        self, connection: socket.socket, peer: PeerIdentity, data: bytes, reason: str, message: str
    ) -> None:
        await _reject_raw(connection, reason, message)
        if self._on_rejected is not None:
            try:
                await self._on_rejected(peer, data, reason, message)
            except Exception:
                log.exception("could not record a rejected workload request")

    async def _run_handler(
        self, connection: socket.socket, peer: PeerIdentity, request: RunRequest, fds: StdioFds
    ) -> None:
        reader, writer = await asyncio.open_unix_connection(sock=connection)
        channel = Channel(peer, reader, writer)
        try:
            await self._handler.handle(request, fds, channel)
        except Exception as error:
            log.exception("workload handler failed for pod %s", request.pod)
            if not channel.finished:
                await channel.send(Rejected(reason="internal-error", message=str(error)))
        finally:
            await channel.close()

    async def _run_attach(
        self, connection: socket.socket, peer: PeerIdentity, request: AttachRequest
    ) -> None:
        reader, writer = await asyncio.open_unix_connection(sock=connection)
        channel = Channel(peer, reader, writer, connection)
        try:
            await self._handler.attach(request, channel)
        except Exception as error:
            log.exception("workload handler failed for the hook of pid %d", peer.pid)
            if not channel.finished:
                await channel.send(Rejected(reason="internal-error", message=str(error)))
        finally:
            await channel.close()


async def _reject_raw(connection: socket.socket, reason: str, message: str) -> None:
    log.info("rejected a workload request (%s): %s", reason, message)
    with contextlib.suppress(OSError):
        await asyncio.get_running_loop().sock_sendall(
            connection, encode_line(Rejected(reason=reason, message=message))
        )
