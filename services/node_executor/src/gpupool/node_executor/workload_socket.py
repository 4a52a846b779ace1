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
import errno
import logging
import os
import resource
import socket
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import Protocol

import msgspec

from gpupool.node_executor.peer_identity import PeerIdentity, identify_peer
from gpupool.node_executor.socket_refusals import (
    DEFAULT_INDIVIDUALLY_PER_INTERVAL,
    DEFAULT_INTERVAL_SECONDS,
    Refusal,
    RefusalLog,
    RefusalSummary,
)
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
from gpupool.workload.fd_passing import (
    LineTooLong,
    TooManyFds,
    receive_line_with_fds,
    send_with_fds,
)

log = logging.getLogger(__name__)

SOCKET_MODE = 0o660
"""Owner and group (the pods' supplemental group, set by the deployment) may connect."""
DEFAULT_REQUEST_TIMEOUT_SECONDS = 10.0
"""A client must send its whole request line within this time after connecting."""


RejectionRecorder = Callable[[PeerIdentity, bytes, str, str], Awaitable[None]]
"""Records one refused request: (peer, bytes, reason, message)."""
SummaryRecorder = Callable[[RefusalSummary], Awaitable[None]]
"""Records the refusals of an interval that were counted rather than recorded one by one."""


class SocketLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What one caller, one connection and all of them together may cost the executor.

    Each connection may carry one request (with at most ``PASSED_FDS`` fds) and nothing after
    it. Connections are limited in all and per uid; new connections of a uid are rate limited
    (a token bucket); ``fd_reserve`` descriptors are kept free for the service itself (NATS,
    pidfds, the commands' start), so a flood of connections is refused, never fatal.
    """

    request_timeout_seconds: float = DEFAULT_REQUEST_TIMEOUT_SECONDS
    max_request_bytes: int = MAX_REQUEST_BYTES
    max_connections: int = 1024
    max_connections_per_uid: int = 256
    connections_per_second_per_uid: float = 50.0
    connection_burst_per_uid: int = 100
    max_bytes_after_request: int = 65536
    """A client sends nothing after its request; past this many bytes it is cut off."""
    fd_reserve: int = 64
    fds_per_connection: int = 5
    """Descriptors one connection may hold: itself, the three passed, one spare."""


class _PeerBudget:
    """One uid's open connections and its token bucket of new ones."""

    __slots__ = ("open", "tokens", "updated")

    def __init__(self, burst: int, now: float) -> None:
        self.open = 0
        self.tokens = float(burst)
        self.updated = now


class Channel:
    """The executor's side of one connection: send messages, learn when the client went away."""

    def __init__(
        self,
        peer: PeerIdentity,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        connection: socket.socket | None = None,
        *,
        on_chatter: Callable[[int], None] | None = None,
        on_refusal: Callable[[str, str], None] | None = None,
        on_claim: Callable[[str, str], bool] | None = None,
        max_bytes_after_request: int = SocketLimits().max_bytes_after_request,
    ) -> None:
        self.peer = peer
        self._writer = writer
        self._connection = connection
        self._gone = asyncio.Event()
        self._finished = False
        self._on_chatter = on_chatter
        self._on_refusal = on_refusal
        self._on_claim = on_claim
        self._max_chatter = max_bytes_after_request
        self._watch = asyncio.create_task(self._watch_for_hangup(reader))

    async def _watch_for_hangup(self, reader: asyncio.StreamReader) -> None:
        # The client sends nothing after its request: any read that returns is EOF or noise,
        # and past a limit of noise the client is cut off (refused, and taken as gone).
        received = 0
        with contextlib.suppress(ConnectionError):
            while chunk := await reader.read(4096):
                received += len(chunk)
                if received > self._max_chatter:
                    if self._on_chatter is not None:
                        self._on_chatter(received)
                    self._writer.close()
                    break
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

    def refuse(self, reason: str, message: str) -> None:
        """Have a refusal decided above the socket (a caller not allowed) recorded like its own."""
        if self._on_refusal is not None:
            self._on_refusal(reason, message)

    def claim_refusal(self, reason: str, message: str) -> bool:
        """Count a refusal the service records as its own event: True to record it now, False
        when, under a flood, it was counted for the socket's summary instead."""
        return self._on_claim(reason, message) if self._on_claim is not None else True

    async def close(self) -> None:
        self._watch.cancel()
        self._writer.close()
        with contextlib.suppress(ConnectionError):
            await self._writer.wait_closed()


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
    """Serves ``handler`` on the Unix socket at ``path`` until closed (an async context manager).

    Every refusal is answered (``Rejected`` with the reason, where the client can still read
    it) and recorded through ``on_rejected`` / ``on_summary`` (see :mod:`socket_refusals`).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        handler: WorkloadHandler,
        *,
        mode: int = SOCKET_MODE,
        request_timeout_seconds: float | None = None,
        limits: SocketLimits | None = None,
        on_rejected: RejectionRecorder | None = None,
        on_summary: SummaryRecorder | None = None,
        refusal_interval_seconds: float = DEFAULT_INTERVAL_SECONDS,
        refusals_recorded_individually: int = DEFAULT_INDIVIDUALLY_PER_INTERVAL,
    ) -> None:
        self.path = Path(path)
        self._handler = handler
        limits = limits if limits is not None else SocketLimits()
        if request_timeout_seconds is not None:
            limits = msgspec.structs.replace(
                limits, request_timeout_seconds=request_timeout_seconds
            )
        self.limits = limits
        self._on_rejected = on_rejected
        self._on_summary = on_summary
        self.refusals = RefusalLog(
            self._record_one,
            self._record_summary,
            interval_seconds=refusal_interval_seconds,
            individually_per_interval=refusals_recorded_individually,
        )
        self._mode = mode
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._peers: dict[int, _PeerBudget] = {}
        self._spare_fd: int | None = None
        self.max_connections = limits.max_connections
        """``limits.max_connections``, lowered to what the fd limit leaves after the reserve."""

    async def _record_one(self, refusal: Refusal) -> None:
        if self._on_rejected is not None:
            peer = PeerIdentity(pid=refusal.pid, uid=refusal.uid, gid=-1)
            await self._on_rejected(peer, refusal.data, refusal.reason, refusal.message)

    async def _record_summary(self, summary: RefusalSummary) -> None:
        if self._on_summary is not None:
            await self._on_summary(summary)

    def _fit_to_fd_limit(self) -> None:
        """Raise the soft fd limit to the hard one; connections get what the reserve leaves."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
                soft = wanted
        room = max(1, (soft - self.limits.fd_reserve) // self.limits.fds_per_connection)
        self.max_connections = min(self.limits.max_connections, room)

    async def start(self) -> None:
        if self.path.exists() or self.path.is_symlink():
            if not stat.S_ISSOCK(self.path.lstat().st_mode):
                raise FileExistsError(f"{self.path} exists and is not a socket")
            self.path.unlink()  # a stale socket of an earlier run
        self._fit_to_fd_limit()
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
        self._spare_fd = os.open(os.devnull, os.O_RDONLY)
        self._accepting = asyncio.create_task(self._accept_forever(listener))
        log.info(
            "serving workloads on %s (at most %d connections, %d per uid)",
            self.path,
            self.max_connections,
            self.limits.max_connections_per_uid,
        )

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
        if self._spare_fd is not None:
            os.close(self._spare_fd)
            self._spare_fd = None
        await self.refusals.close()

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
            except OSError as error:
                if error.errno in (errno.EMFILE, errno.ENFILE):
                    # (accept fails so even with nothing pending: then wait for a caller)
                    if not self._refuse_without_fds(listener):
                        await _readable(listener)
                else:
                    log.warning("accept failed on %s: %s", self.path, error)
                continue
            self._admit(connection)

    def _refuse_without_fds(self, listener: socket.socket) -> bool:
        """Out of descriptors: free the spare one to accept and refuse the caller, then retake it.

        False when no caller was waiting.
        """
        if self._spare_fd is not None:
            os.close(self._spare_fd)
            self._spare_fd = None
        refused = False
        try:
            connection, _ = listener.accept()
        except BlockingIOError:
            pass
        except OSError as error:
            log.warning("accept failed on %s: %s", self.path, error)
        else:
            refused = True
            with connection:
                peer = _peer_or_unknown(connection)
                self._refuse_now(
                    connection, peer, "overloaded", "the node-executor is out of file descriptors"
                )
        with contextlib.suppress(OSError):
            self._spare_fd = os.open(os.devnull, os.O_RDONLY)
        return refused

    def _admit(self, connection: socket.socket) -> None:
        """Serve a new connection, or refuse it at once when it is over a limit."""
        connection.setblocking(False)
        peer = _peer_or_unknown(connection)
        now = asyncio.get_running_loop().time()
        budget = self._peers.get(peer.uid)
        if budget is None:
            if len(self._peers) > MAX_PEERS_TRACKED:
                self._forget_idle_peers(now)
            budget = self._peers[peer.uid] = _PeerBudget(self.limits.connection_burst_per_uid, now)
        limits = self.limits
        budget.tokens = min(
            float(limits.connection_burst_per_uid),
            budget.tokens + (now - budget.updated) * limits.connections_per_second_per_uid,
        )
        budget.updated = now
        refusal: tuple[str, str] | None = None
        if len(self._connections) >= self.max_connections:
            refusal = (
                "overloaded",
                f"the node-executor serves {self.max_connections} connections already",
            )
        elif budget.open >= limits.max_connections_per_uid:
            refusal = (
                "too-many-connections",
                f"uid {peer.uid} has {budget.open} connections open (at most "
                f"{limits.max_connections_per_uid})",
            )
        elif budget.tokens < 1.0:
            refusal = (
                "rate-limited",
                f"uid {peer.uid} connects faster than {limits.connections_per_second_per_uid:g}/s",
            )
        if refusal is not None:
            with connection:
                self._refuse_now(connection, peer, *refusal)
            return
        budget.tokens -= 1.0
        budget.open += 1
        task = asyncio.create_task(self._serve(connection, peer))
        self._connections.add(task)

        def done(finished: asyncio.Task[None]) -> None:
            self._connections.discard(finished)
            budget.open -= 1

        task.add_done_callback(done)

    def _forget_idle_peers(self, now: float) -> None:
        limits = self.limits
        for uid, budget in list(self._peers.items()):
            full = budget.tokens + (now - budget.updated) * limits.connections_per_second_per_uid
            if budget.open == 0 and full >= limits.connection_burst_per_uid:
                del self._peers[uid]

    def _refuse_now(
        self, connection: socket.socket, peer: PeerIdentity, reason: str, message: str
    ) -> None:
        """Answer without waiting (a line fits an empty socket buffer) and have it recorded."""
        with contextlib.suppress(OSError):
            connection.send(encode_line(Rejected(reason=reason, message=message)))
        self._count(peer, b"", reason, message)

    def _count(self, peer: PeerIdentity, data: bytes, reason: str, message: str) -> None:
        log.debug("refused a workload request (%s): %s", reason, message)
        self.refusals.refuse(
            Refusal(
                reason=reason,
                message=message,
                pid=peer.pid,
                uid=peer.uid,
                data=data[:REFUSED_BYTES_KEPT],
            )
        )

    async def _serve(self, connection: socket.socket, peer: PeerIdentity) -> None:
        fds: list[int] = []
        try:
            try:
                async with asyncio.timeout(self.limits.request_timeout_seconds):
                    line, fds = await receive_line_with_fds(
                        connection, self.limits.max_request_bytes, max_fds=PASSED_FDS
                    )
            except TimeoutError:
                await self._reject(
                    connection, peer, b"", "request-timeout", "no complete request in time"
                )
                return
            except LineTooLong as error:
                await self._reject(connection, peer, b"", "request-too-large", str(error))
                return
            except TooManyFds as error:
                await self._reject(connection, peer, b"", "too-many-fds", str(error))
                return
            if not line.endswith(b"\n"):
                await self._reject(
                    connection,
                    peer,
                    line,
                    "partial-request",
                    f"the connection ended {len(line)} bytes into a request, before its newline",
                )
                return
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
        except Exception as error:  # no input may stop the service: answer, record, go on
            log.exception("a workload connection failed unexpectedly")
            await self._reject(
                connection, peer, b"", "internal-error", f"{type(error).__name__}: {error}"
            )
        finally:
            for fd in fds:
                os.close(fd)
            connection.close()

    async def _reject(
        self, connection: socket.socket, peer: PeerIdentity, data: bytes, reason: str, message: str
    ) -> None:
        await _reject_raw(connection, reason, message)
        self._count(peer, data, reason, message)

    def _chatter(self, peer: PeerIdentity) -> Callable[[int], None]:
        def refuse(received: int) -> None:
            self._count(
                peer,
                b"",
                "unexpected-data",
                f"{received} bytes after the request (at most "
                f"{self.limits.max_bytes_after_request}); the connection was closed",
            )

        return refuse

    async def _run_handler(
        self, connection: socket.socket, peer: PeerIdentity, request: RunRequest, fds: StdioFds
    ) -> None:
        reader, writer = await asyncio.open_unix_connection(sock=connection)
        channel = Channel(
            peer,
            reader,
            writer,
            on_chatter=self._chatter(peer),
            on_refusal=lambda reason, message: self._count(peer, b"", reason, message),
            on_claim=lambda reason, message: self.refusals.claim(
                Refusal(reason=reason, message=message, pid=peer.pid, uid=peer.uid)
            ),
            max_bytes_after_request=self.limits.max_bytes_after_request,
        )
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
        channel = Channel(
            peer,
            reader,
            writer,
            connection,
            on_chatter=self._chatter(peer),
            on_refusal=lambda reason, message: self._count(peer, b"", reason, message),
            on_claim=lambda reason, message: self.refusals.claim(
                Refusal(reason=reason, message=message, pid=peer.pid, uid=peer.uid)
            ),
            max_bytes_after_request=self.limits.max_bytes_after_request,
        )
        try:
            await self._handler.attach(request, channel)
        except Exception as error:
            log.exception("workload handler failed for the hook of pid %d", peer.pid)
            if not channel.finished:
                await channel.send(Rejected(reason="internal-error", message=str(error)))
        finally:
            await channel.close()


MAX_PEERS_TRACKED = 4096
"""Budgets of uids with nothing open and a full bucket are forgotten past this many."""
REFUSED_BYTES_KEPT = 4096
"""How much of a refused request is kept for its record."""


def _peer_or_unknown(connection: socket.socket) -> PeerIdentity:
    try:
        return identify_peer(connection)
    except OSError:
        return PeerIdentity(pid=0, uid=-1, gid=-1)


async def _readable(listener: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(listener.fileno(), wake)
    try:
        await ready
    finally:
        loop.remove_reader(listener.fileno())


async def _reject_raw(connection: socket.socket, reason: str, message: str) -> None:
    log.info("rejected a workload request (%s): %s", reason, message)
    with contextlib.suppress(OSError, TimeoutError):
        async with asyncio.timeout(REJECT_SEND_SECONDS):
            await asyncio.get_running_loop().sock_sendall(
                connection, encode_line(Rejected(reason=reason, message=message))
            )


REJECT_SEND_SECONDS = 1.0
"""A refused client that does not read its answer is not waited for longer than this."""
