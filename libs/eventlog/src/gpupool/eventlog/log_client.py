"""nats-py's client with *raw subscriptions*: deliveries handed over as bytes, at once.

A plain nats-py subscription pays, for every message, a parse of its header block into
a dict (name by name, character by character), a ``Msg`` object with its subject and
reply decoded, a put into the subscription's queue and a task switch to the task that
calls the callback. The log's hot paths need none of that: a durable's delivery is
its reply subject (the stream sequence, the ack), its subject and its bytes; its stored
headers (``Nats-Msg-Id``, the expectations) are never read there; only a status
(heartbeat, expired pull) must be told apart, and that is the header block's first
line.

:class:`LogClient` is nats-py's ``Client`` (same connect options, reconnects,
JetStream context, TLS, credentials) where :meth:`LogClient.raw_subscribe` registers a
synchronous *sink* for a subscription: the reader loop calls it with the undecoded
parts of every message of that subscription, and nothing else is done for it;
:meth:`LogClient.raw_inbox` registers three lists instead (a :class:`RawInbox`): the
reader loop appends each delivery's subject, reply subject and data to them, and tells it
once per read of the socket (and before
any other operation or a nats-py subscription's message in that read), not once per
message (a replay's pulls). Every other subscription is nats-py's own.

The reader loop cuts the message frames out of its buffer itself (:class:`_FrameParser`):
a delivery's control line as the server spells it is read with one regular expression
(any other spelling field by field, with nats-py's verdicts); a raw subscription's frame
goes to its sink or inbox without an ``await``, the client's statistics counted once per
read; another subscription's goes to nats-py's message handling; a frame still arriving
waits in the buffer for the rest; every other operation (PING, PONG, INFO, +OK, -ERR) is
handed, its line alone, to nats-py's own parser. One pass over the buffer, in the
connection's order.

The sink runs inside the client's reader loop: it must not block and must not raise
(an exception would end the reader loop); it should append to a buffer and wake a
waiter, or ask for a callback once the reader has cut everything it read
(:meth:`LogClient.after_read`: the consumer's batch folded and reacted to within the
reader's step, docs/eventlog.md "Deciding in the reader's step").
:func:`inline_status` reads a status message's code from the header block.

Writes: nats-py queues every frame and wakes its flusher task, which writes whatever is
queued when its turn of the event loop comes, behind every callback already waiting
(another connection's flusher, other tasks). :meth:`LogClient.write_now` writes the queued
frames at once instead, in the caller's step, when that costs nothing the flusher would
save: connected over TCP (or TLS), nothing waiting in the socket's own buffer (no
backpressure to wait for), and no frame written that way yet in this turn of the loop (a
burst's frames are still coalesced by the flusher into one write).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from typing import Any, Protocol

from nats.aio.client import PING_PROTO, Client
from nats.aio.subscription import Subscription
from nats.aio.transport import TcpTransport
from nats.errors import ProtocolError
from nats.protocol.parser import AWAITING_CONTROL_LINE, MAX_CONTROL_LINE_SIZE, Parser

RawSink = Callable[[bytes, bytes, bytes, bytes | None], None]
"""``sink(subject, reply, data, headers)``: the undecoded parts of one message; ``headers``
is the raw header block (``NATS/1.0 …\\r\\n…``) or None."""

_STATUS_LINE = b"NATS/1.0 "

logger = logging.getLogger(__name__)


class RawInbox(Protocol):
    """A raw subscription that takes its deliveries as lists (:meth:`LogClient.raw_inbox`):
    the reader loop appends each delivery's subject, reply subject and data to ``subjects``,
    ``replies`` and ``datas`` (its stored headers unread; the three lists always of one
    length), hands each status message's header block to ``on_status``, and calls
    ``on_delivered`` once it has appended what one read of the socket held (not once per
    delivery). Neither call may block or raise.

    Three lists rather than one of ``(subject, reply, data)``: a reader takes each column
    whole (the reply subjects in one split, the data in one decode) without a tuple per
    delivery made here and taken apart there (a replay's pull holds 1,024 of them, read
    once the pull has arrived, by then out of the core's cache)."""

    subjects: list[bytes]
    replies: list[bytes]
    datas: list[bytes]

    def on_status(self, headers: bytes) -> None: ...

    def on_delivered(self) -> None: ...


def inline_status(headers: bytes | None) -> bytes | None:
    """A status message's three-digit code (``b"100"``, ``b"404"``, …), None for a plain one.

    The server writes a status on the header block's first line (``NATS/1.0 408 Request
    Timeout``); a message with stored headers only starts ``NATS/1.0\\r\\n``.
    """
    if headers is None or not headers.startswith(_STATUS_LINE):
        return None
    return headers[9:12]


def status_description(headers: bytes) -> str:
    """The text after a status code on the first line (``Request Timeout``), or ''."""
    first = headers.split(b"\r\n", 1)[0]
    return first[13:].decode("utf-8", "replace").strip()


def header_value(headers: bytes | None, name: str) -> str | None:
    """One header's value from a raw header block (for the rare message that needs one)."""
    if not headers:
        return None
    wanted = name.lower().encode("ascii")
    for line in headers.split(b"\r\n")[1:]:
        key, sep, value = line.partition(b":")
        if sep and key.strip().lower() == wanted:
            return value.strip().decode("utf-8", "replace")
    return None


async def _never_called(msg: Any) -> None:  # pragma: no cover - a raw sid never reaches it
    raise AssertionError("a raw subscription's message reached nats-py's callback")


_MSG_LINE = re.compile(rb"MSG (\S+) (\d+) (?:(\S+) )?(\d+)\r\n")
_HMSG_LINE = re.compile(rb"HMSG (\S+) (\d+) (?:(\S+) )?(\d+) (\d+)\r\n")
"""A delivery's control line as the server writes it (one space between the fields), read
with one match; any other spelling goes to ``_delivery_line``, which gives the verdict."""
_M, _H = ord("M"), ord("H")
_ANOTHER_OPERATION = -1


def _delivery_line(buf: bytearray, pos: int) -> tuple[bytes, int, bytes, int, int, int] | int:
    """The MSG or HMSG control line at ``pos``: (subject, sid, reply, header size, size,
    where its payload starts); ``_ANOTHER_OPERATION``, or 0 while the line is still arriving.

    ``ProtocolError`` for a malformed one, as nats-py has it. (No length limit on a
    delivery's line, as nats-py has none: the server limits what clients publish, and adds
    a subscription id and a reply to it.)"""
    if buf.startswith(b"HMSG ", pos):
        headered = True
    elif buf.startswith(b"MSG ", pos):
        headered = False
    else:
        return _ANOTHER_OPERATION
    end = buf.find(b"\r\n", pos)
    if end < 0:
        return 0
    args = bytes(buf[pos:end]).split()
    count = len(args)
    # MSG <subject> <sid> [reply] <size>; HMSG <subject> <sid> [reply] <hdr size> <size>
    shortest = 5 if headered else 4
    if not (
        shortest <= count <= shortest + 1
        and args[2].isdigit()
        and args[-1].isdigit()
        and (not headered or args[-2].isdigit())
    ):
        raise ProtocolError("nats: malformed MSG")
    reply = args[3] if count > shortest else b""
    header_size = int(args[-2]) if headered else 0
    return args[1], int(args[2]), reply, header_size, int(args[-1]), end + 2


class _FrameParser(Parser):
    """nats-py's parser with the message frames cut out here (see the module's docstring),
    then what the sinks asked to run once the data read is cut (:meth:`LogClient.after_read`)."""

    nc: LogClient

    async def parse(self, data: bytes = b"") -> None:
        nc = self.nc
        nc._parsing = True
        try:
            await self._cut(data)
        finally:
            nc._parsing = False
            if nc._after_read:
                if _more_buffered(nc):
                    # the reader's next read returns at once, within this step: the
                    # callbacks run after it (a burst's deliveries stay one batch); the
                    # turn's end runs them should the reader stop before
                    asyncio.get_running_loop().call_soon(nc._run_after_read)
                else:
                    nc._run_after_read()

    async def _cut(self, data: bytes) -> None:
        """Cut what was read into frames, in the connection's order."""
        buf = self.buf
        buf.extend(data)
        if self.state != AWAITING_CONTROL_LINE:  # nats-py's parser stopped inside a frame
            await super().parse()
            if self.state != AWAITING_CONTROL_LINE or self.buf is not buf:
                return
        nc = self.nc
        sinks = nc._raw_sinks
        inboxes = nc._raw_inboxes
        subs = nc._subs
        msg_line = _MSG_LINE.match
        hmsg_line = _HMSG_LINE.match
        counted = _Counted(nc.stats)
        pos = 0
        size = len(buf)
        try:
            while pos < size:
                first = buf[pos]
                match = (
                    msg_line(buf, pos)
                    if first == _M
                    else hmsg_line(buf, pos)
                    if first == _H
                    else None
                )
                if match is not None:
                    if first == _M:
                        subject, sid_text, reply, size_text = match.groups()
                        header_size = 0
                        run_sid = sid_text
                    else:
                        subject, sid_text, reply, header_text, size_text = match.groups()
                        header_size = int(header_text)
                        run_sid = b""  # (no run of plain frames follows a headered one)
                    total = int(size_text)
                    sid = int(sid_text)
                    start = match.end()
                    if reply is None:
                        reply = b""
                else:
                    line = _delivery_line(buf, pos)
                    if line == 0:
                        break  # the control line is still arriving
                    if line == _ANOTHER_OPERATION:
                        # Another operation (PING, PONG, INFO, +OK, -ERR): its line alone goes
                        # to nats-py's parser; a line still arriving waits, as nats-py's does.
                        counted.settle()
                        del buf[:pos]
                        pos = 0
                        end = buf.find(b"\r\n")
                        if end < 0:
                            if len(buf) >= MAX_CONTROL_LINE_SIZE:
                                await super().parse()  # nats-py's own verdict on a runaway line
                            return
                        rest = bytes(buf[end + 2 :])
                        del buf[end + 2 :]
                        await super().parse()
                        if self.buf is not buf:  # the connection was reset meanwhile
                            return
                        buf.extend(rest)
                        if self.state != AWAITING_CONTROL_LINE:  # it took a frame's line
                            await super().parse()
                            if self.state != AWAITING_CONTROL_LINE or self.buf is not buf:
                                return
                        size = len(buf)
                        continue
                    assert not isinstance(line, int)
                    subject, sid, reply, header_size, total, start = line
                    run_sid = b""  # (an odd spelling: no run of plain frames follows it)
                if header_size > total:
                    raise ProtocolError("nats: malformed MSG")
                if start + total + 2 > size:
                    break  # the frame is still arriving: wait for the rest
                inbox = inboxes.get(sid)
                if inbox is not None and sid in subs:
                    counted.messages += 1
                    counted.bytes += total - header_size
                    if header_size and buf.startswith(_STATUS_LINE, start, start + header_size):
                        inbox.on_status(bytes(buf[start : start + header_size]))
                    else:
                        inbox.subjects.append(subject)
                        inbox.replies.append(reply)
                        inbox.datas.append(bytes(buf[start + header_size : start + total]))
                        if inbox is not counted.last:
                            counted.touch(inbox)
                    pos = start + total + 2
                    if run_sid:  # a plain frame as the server spells it: the frames after
                        # it for the same inbox, cut in one loop (a replay's pull)
                        pos, run, run_bytes = _inbox_run(buf, pos, size, run_sid, inbox)
                        counted.messages += run
                        counted.bytes += run_bytes
                    continue
                headers = bytes(buf[start : start + header_size]) if header_size else None
                payload = bytes(buf[start + header_size : start + total])
                pos = start + total + 2
                sink = sinks.get(sid)
                if sink is not None and sid in subs:
                    counted.messages += 1
                    counted.bytes += total - header_size
                    sink(subject, reply, payload, headers)
                    continue
                # any other subscription's message: nats-py's own handling
                counted.settle()
                del buf[:pos]
                pos = 0
                await nc._process_msg(sid, subject, reply, payload, headers)
                if self.buf is not buf:
                    return
                size = len(buf)
        finally:
            counted.settle()
        if pos:
            del buf[:pos]


def _inbox_run(
    buf: bytearray, pos: int, size: int, sid_text: bytes, inbox: RawInbox
) -> tuple[int, int, int]:
    """The plain frames from ``pos`` on for the subscription ``sid_text`` names, as the
    server spells them, appended to ``inbox`` as the parser's loop appends each: as long as
    each is whole and for the same subscription spelt the same, no header block, no status.
    Returns where the run stopped (the next frame, for the parser's loop to read), how many
    frames it appended and their payloads' bytes. Nothing is awaited (no subscription can
    end meanwhile)."""
    match_line = _MSG_LINE.match
    add_subject = inbox.subjects.append
    add_reply = inbox.replies.append
    add_data = inbox.datas.append
    count = payload_bytes = 0
    with memoryview(buf) as view:  # (released before the buffer is resized again)
        while pos < size:
            match = match_line(buf, pos)
            if match is None:
                break
            subject, sid_text_here, reply, size_text = match.groups()
            if sid_text_here != sid_text:
                break
            start = match.end()
            end = start + int(size_text)
            if end + 2 > size:
                break  # still arriving
            add_subject(subject)
            add_reply(b"" if reply is None else reply)
            add_data(view[start:end].tobytes())
            count += 1
            payload_bytes += end - start
            pos = end + 2
    return pos, count, payload_bytes


class _Counted:
    """What one parse call handed to raw subscriptions: counted into the client's statistics,
    and each inbox that got deliveries told so, once per call (``settle``) rather than per
    message."""

    __slots__ = ("bytes", "last", "messages", "stats", "touched")

    def __init__(self, stats: dict[str, int]) -> None:
        self.stats = stats
        self.messages = 0
        self.bytes = 0
        self.last: RawInbox | None = None
        self.touched: list[RawInbox] = []

    def touch(self, inbox: RawInbox) -> None:
        self.last = inbox
        if inbox not in self.touched:
            self.touched.append(inbox)

    def settle(self) -> None:
        if self.messages:
            self.stats["in_msgs"] += self.messages
            self.stats["in_bytes"] += self.bytes
            self.messages = self.bytes = 0
        if self.touched:
            touched, self.touched, self.last = self.touched, [], None
            for inbox in touched:
                inbox.on_delivered()


def _more_buffered(nc: Client) -> bool:
    """The connection's stream reader holds bytes not read yet (asyncio's buffer)."""
    reader = getattr(nc._transport, "_io_reader", None)
    return bool(getattr(reader, "_buffer", None))


class LogClient(Client):
    """A nats-py client whose raw subscriptions skip the per-message machinery."""

    def __init__(self) -> None:
        super().__init__()
        self._raw_sinks: dict[int, RawSink] = {}
        self._raw_inboxes: dict[int, RawInbox] = {}
        self._ps = _FrameParser(self)
        self._parsing = False
        self._after_read: list[Callable[[], None]] = []
        """Callbacks sinks queued during this parse (:meth:`after_read`)."""
        self._wrote_now = False
        """A :meth:`write_now` wrote in this turn of the event loop (reset on the next turn)."""

    def write_now(self, *, takes_turn: bool = True) -> bool:
        """Write the queued frames to the socket now, in order; False where the flusher must.

        The flusher writes them where this does not: not connected (reconnecting frames
        wait in the queue), not a TCP transport (a websocket's writes are its own tasks),
        the socket's buffer not empty (the flusher waits for it to drain), or a frame
        already written this way in this turn of the loop (the rest of the turn's frames
        go in the flusher's one write). The flusher, if woken, then finds nothing queued.
        ``takes_turn`` False (a consumed batch's acks, its last frames): the write does not
        count as the turn's one, so a decision made next in the same step is written too.
        """
        if self._wrote_now or not self._pending or not self.is_connected:
            return False
        transport = self._transport
        if type(transport) is not TcpTransport or self._flusher_task is None:
            return False
        if self._flusher_task.done():
            return False
        writer = transport._io_writer
        if writer is None or writer.transport.get_write_buffer_size():
            return False
        if takes_turn:
            self._wrote_now = True
            asyncio.get_running_loop().call_soon(self._next_turn)
        transport.writelines(self._pending)  # type: ignore[no-untyped-call]  # nats-py: untyped
        self._pending = []
        self._pending_data_size = 0
        return True

    def _next_turn(self) -> None:
        self._wrote_now = False

    def after_read(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` in the reader's step once the data it read is cut into frames
        (every sink of that data has run); called from a sink. While asyncio's buffer
        holds more bytes, after the parse of those (the reader reads them within the same
        step), or at the turn's end if the reader stops first. Outside a parse (no sink
        is): on the next turn of the loop.

        The callback runs in the reader task's step, after its parse loop: it may call
        what the sinks' owners do with their deliveries (fold, decide, write frames), but
        must not await the connection's answers there (the reader reads them); an
        exception it raises is logged and does not reach the reader loop."""
        if self._parsing:
            self._after_read.append(callback)
        else:
            asyncio.get_running_loop().call_soon(callback)

    def _run_after_read(self) -> None:
        callbacks, self._after_read = self._after_read, []
        for callback in callbacks:
            try:
                callback()
            except Exception:
                logger.exception("a callback after reading the connection failed")

    async def _send_ping(self, future: asyncio.Future[Any] | None = None) -> None:
        """A PING queued behind the frames already waiting, so that its PONG (``flush()``)
        means the server has them.

        nats-py 2.16 writes the PING to the socket at once, ahead of the frames still
        queued for the flusher: a ``subscribe()`` then ``flush()`` could return before the
        server had the subscription, and a publish from another connection then found no
        interest ("no responders")."""
        if future is None:
            future = asyncio.get_running_loop().create_future()
        self._pongs.append(future)
        await self._send_command(PING_PROTO)
        await self._flush_pending()

    async def raw_subscribe(self, subject: str, sink: RawSink) -> Subscription:
        """Subscribe ``subject`` with ``sink`` called for each message (see the module).

        The returned subscription is nats-py's: ``unsubscribe()`` ends it, and a reconnect
        subscribes it again, as any other.
        """
        subscription = await self.subscribe(subject, cb=_never_called)
        self._raw_sinks[subscription._id] = sink
        return subscription

    async def raw_inbox(self, subject: str, inbox: RawInbox) -> Subscription:
        """Subscribe ``subject`` with its deliveries appended to ``inbox`` (:class:`RawInbox`):
        :meth:`raw_subscribe` without a call per message; ended as that one is."""
        subscription = await self.subscribe(subject, cb=_never_called)
        self._raw_inboxes[subscription._id] = inbox
        return subscription

    def drop_raw(self, subscription: Subscription) -> None:
        """Forget a raw subscription's sink once it has ended (after ``unsubscribe``).

        One whose unsubscribe failed (the connection draining, say) keeps its sink: its
        late deliveries still reach the sink, not nats-py's callback, and the sink is
        forgotten at the first delivery after the subscription ends."""
        if subscription._id not in self._subs:
            self._raw_sinks.pop(subscription._id, None)
            self._raw_inboxes.pop(subscription._id, None)

    async def _process_msg(
        self,
        sid: int,
        subject: bytes,
        reply: bytes,
        data: bytes,
        headers: bytes | None,
    ) -> None:
        inbox = self._raw_inboxes.get(sid)
        sink = self._raw_sinks.get(sid)
        if sink is None and inbox is None:
            await super()._process_msg(sid, subject, reply, data, headers)  # type: ignore[arg-type]
            return
        if sid not in self._subs:  # unsubscribed: late messages are dropped, as nats-py does
            self._raw_sinks.pop(sid, None)
            self._raw_inboxes.pop(sid, None)
            return
        self.stats["in_msgs"] += 1
        self.stats["in_bytes"] += len(data)
        if inbox is None:
            assert sink is not None
            sink(subject, reply, data, headers)
        elif headers is not None and headers.startswith(_STATUS_LINE):
            inbox.on_status(headers)
        else:
            inbox.subjects.append(subject)
            inbox.replies.append(reply)
            inbox.datas.append(data)
            inbox.on_delivered()
