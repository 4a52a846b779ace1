"""The log's writes on the wire: acks and JetStream publishes framed here, PubAcks muxed raw.

nats-py's ``js.publish`` pays, for every append, a header dict checked key by key, a
``request`` with its own future and ``wait_for`` timer, the reply parsed into a ``Msg``
(its headers too), ``json.loads`` and a ``PubAck`` built field by field. A delivery's
ack is a ``Msg.ack()``: a full ``publish`` with its checks. The log needs none of that:

* :func:`send_frame` queues one protocol frame on the connection's outgoing buffer, with
  nats-py's own checks (closed, draining, buffer full while reconnecting, payload too
  large) and its flusher (one write for everything queued before the loop turns).
* :func:`ack_frame` is a delivery's ack or nak (``PUB <reply> 4\\r\\n+ACK\\r\\n``).
* :class:`PubAckMux` publishes with a reply on one wildcard inbox, raw-subscribed
  (:meth:`gpupool.eventlog.log_client.LogClient.raw_subscribe`): each request is a token
  and a future; the PubAck is decoded with msgspec; no timer per request: one sweeper
  task fails the requests older than the timeout, oldest first, with nats-py's
  ``TimeoutError``, the error ``js.publish`` raised.

docs/eventlog.md ("The transport: raw subscriptions, framed writes") says why.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence

import msgspec
import nats.errors
import nats.js.errors

from gpupool.eventlog.log_client import LogClient, inline_status, status_description

ACK = b"+ACK"
NAK = b"-NAK"
_NO_RESPONDERS = b"503"
_SUBJECT_INVALID = re.compile(rb"[ \t\r\n]")
_VALUE_NEWLINES = bytes.maketrans(b"\r\n", b"  ")


def header_value(value: str) -> bytes:
    """A header value as nats-py writes it: trimmed, CR/LF made spaces."""
    encoded = value.strip().encode()
    if b"\r" in encoded or b"\n" in encoded:
        encoded = encoded.translate(_VALUE_NEWLINES)
    return encoded


def header_block(pairs: list[tuple[bytes, str]]) -> bytes:
    """A NATS header block (``NATS/1.0\r\nName: value\r\n…\r\n``) from fixed names."""
    return b"NATS/1.0\r\n%b\r\n" % b"".join(
        b"%b: %b\r\n" % (name, header_value(value)) for name, value in pairs
    )


def ack_frame(reply: bytes, verb: bytes = ACK) -> bytes:
    """The frame acknowledging (``ACK``) or refusing (``NAK``) the delivery of ``reply``."""
    return b"PUB %b %d\r\n%b\r\n" % (reply, len(verb), verb)


def check_subject(subject: bytes) -> None:
    """nats-py's publish check: a subject is not empty and holds no whitespace (a CR/LF
    would inject protocol commands)."""
    if not subject or _SUBJECT_INVALID.search(subject):
        raise nats.errors.BadSubjectError


async def send_frame(
    nc: LogClient,
    frame: bytes,
    payload_size: int = 0,
    *,
    now: bool = False,
    takes_turn: bool = True,
) -> None:
    """Queue one frame for the connection's flusher, with nats-py's publish checks.

    While reconnecting the frame waits in nats-py's buffer (sent after the reconnect),
    unless the buffer is full: ``OutboundBufferLimitError``, as ``publish`` raises.
    ``now``: written in this step where :meth:`LogClient.write_now` can (with every frame
    queued before it), else left to the flusher; ``takes_turn``: as ``write_now``'s.
    """
    if nc.is_closed:
        raise nats.errors.ConnectionClosedError
    if nc.is_draining_pubs:
        raise nats.errors.ConnectionDrainingError
    if not nc.is_connected and (
        nc._max_pending_size <= 0 or len(frame) + nc._pending_data_size > nc._max_pending_size
    ):
        raise nats.errors.OutboundBufferLimitError
    if payload_size > nc._max_payload:
        raise nats.errors.MaxPayloadError
    nc.stats["out_msgs"] += 1
    nc.stats["out_bytes"] += payload_size
    await nc._send_command(frame)
    if now and nc.write_now(takes_turn=takes_turn):
        return
    if nc._flush_queue is not None and nc._flush_queue.empty():
        await nc._flush_pending()


class _ApiError(msgspec.Struct):
    code: int = 0
    err_code: int | None = None
    description: str | None = None


class PubAck(msgspec.Struct):
    """The server's answer to a JetStream publish (the fields the log reads)."""

    stream: str = ""
    seq: int = 0
    duplicate: bool = False
    error: _ApiError | None = None


_decode_puback = msgspec.json.Decoder(PubAck).decode


class PubAckMux:
    """JetStream publishes of one connection, their PubAcks on one raw wildcard inbox.

    ``timeout``: a request with no answer after this long fails with
    ``nats.errors.TimeoutError``. The inbox is subscribed on first use; after a
    reconnect nats-py subscribes it again (a PubAck lost with the old connection is a
    timeout, as it was for ``js.publish``).
    """

    def __init__(self, nc: LogClient, *, timeout: float) -> None:
        self._nc = nc
        self.timeout = timeout
        self._prefix = b""
        self._starting: asyncio.Task[None] | None = None
        self._waiting: dict[bytes, tuple[float, asyncio.Future[bytes]]] = {}
        """token -> (deadline, future), oldest first (every request has the same timeout)."""
        self._next_token = 0
        self._sweeper: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def in_flight(self) -> int:
        """Requests sent and neither answered nor timed out."""
        return len(self._waiting)

    async def _start(self) -> None:
        """Subscribe the inbox once; concurrent first publishes wait for the same start."""
        if self._starting is None:
            self._starting = asyncio.get_running_loop().create_task(self._subscribe())
        starting = self._starting
        try:
            await asyncio.shield(starting)
        except BaseException:
            if starting.done() and (starting.cancelled() or starting.exception() is not None):
                self._starting = None  # failed: the next publish tries again
            raise

    async def _subscribe(self) -> None:
        inbox = self._nc.new_inbox()
        await self._nc.raw_subscribe(f"{inbox}.*", self._on_reply)
        self._prefix = inbox.encode() + b"."

    async def submit(
        self, subject: bytes, payload: bytes, headers: bytes, *, now: bool = False
    ) -> asyncio.Future[bytes]:
        """Send one publish; the future gets the PubAck's bytes (or the error).

        ``now``: a lone publish, written in this step where it can be (:func:`send_frame`);
        one sent while others of this connection await their PubAcks (a burst's
        decisions, a pipelined window) is left to the flusher, which writes a turn's
        publishes together."""
        if self._closed:
            raise nats.errors.ConnectionClosedError
        if not self._prefix:
            await self._start()
        check_subject(subject)
        self._next_token += 1
        token = b"%d" % self._next_token
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bytes] = loop.create_future()
        hdr_len = len(headers)
        frame = b"HPUB %b %b%b %d %d\r\n%b%b\r\n" % (
            subject,
            self._prefix,
            token,
            hdr_len,
            hdr_len + len(payload),
            headers,
            payload,
        )
        alone = now and not self._waiting
        self._waiting[token] = (loop.time() + self.timeout, future)  # before any answer can come
        try:
            await send_frame(self._nc, frame, len(payload), now=alone)
        except BaseException:
            self._waiting.pop(token, None)
            raise
        if self._sweeper is None:
            self._sweeper = loop.create_task(self._sweep())
        return future

    def forget(self, futures: Sequence[asyncio.Future[bytes]]) -> None:
        """Stop waiting for the PubAcks of ``futures`` (their callers gave up on them): they
        no longer count as publishes in flight (``submit``'s ``now``), and a late answer
        is dropped as one after its timeout would be."""
        if not futures:
            return
        gone = set(map(id, futures))
        for token in [t for t, (_, f) in self._waiting.items() if id(f) in gone]:
            del self._waiting[token]

    async def publish(self, subject: bytes, payload: bytes, headers: bytes) -> PubAck:
        """Publish and wait for the PubAck; the server's error is raised as nats-py's
        ``APIError`` (``from_error``), no responders as ``NoStreamResponseError``."""
        return await self.result(await self.submit(subject, payload, headers))

    @staticmethod
    async def result(future: asyncio.Future[bytes]) -> PubAck:
        """The PubAck of a submitted publish (raises as :meth:`publish`)."""
        return read_puback(await future)

    def _on_reply(self, subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> None:
        # The reader loop's sink: never raises, never blocks.
        waiting = self._waiting.pop(subject[len(self._prefix) :], None)
        if waiting is None:
            return  # answered after its timeout, or not ours
        future = waiting[1]
        if future.done():
            return  # its caller was cancelled
        status = inline_status(headers)
        if status is None:
            future.set_result(data)
        elif status == _NO_RESPONDERS:
            future.set_exception(nats.js.errors.NoStreamResponseError())
        else:
            assert headers is not None
            future.set_exception(
                nats.js.errors.APIError(
                    code=int(status) if status.isdigit() else 0,
                    description=status_description(headers),
                )
            )

    async def _sweep(self) -> None:
        """Fail the requests past their deadline, oldest first; end when none is left."""
        loop = asyncio.get_running_loop()
        try:
            while self._waiting:
                token, (deadline, future) = next(iter(self._waiting.items()))
                now = loop.time()
                if deadline > now:
                    await asyncio.sleep(deadline - now)
                    continue
                del self._waiting[token]
                if not future.done():
                    future.set_exception(nats.errors.TimeoutError())
        finally:
            self._sweeper = None

    def close(self) -> None:
        """Fail every request still waiting (``ConnectionClosedError``); refuse new ones."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        waiting, self._waiting = self._waiting, {}
        for _, future in waiting.values():
            if not future.done():
                future.set_exception(nats.errors.ConnectionClosedError())


def read_puback(data: bytes) -> PubAck:
    """A PubAck from its JSON; an error answer raised as nats-py's ``APIError`` subclass."""
    try:
        ack = _decode_puback(data)
    except msgspec.DecodeError as exc:
        raise nats.js.errors.APIError(description=f"unreadable PubAck: {exc}") from None
    if ack.error is not None:
        nats.js.errors.APIError.from_error(msgspec.structs.asdict(ack.error))  # raises
    return ack
