"""Reading the JetStream log without any right to change it: for the audit commands and the console.

:class:`ReadOnlyLog` never creates the stream, never creates a durable consumer and
never publishes. Without a credential it reads with *ordered consumers* (ephemeral,
flow-controlled, the server pushes each entry as it is appended); with one (the
``reader`` user) through the reader's own replay consumers
(:mod:`gpupool.eventlog.named_replay`), since no credential may use the nameless
consumer create that ordered consumers need. :meth:`ReadOnlyLog.entries` reads up to a sequence, or follows the
log for as long as it is iterated: no polling.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any, Self
from urllib.parse import urlsplit

import msgspec
import nats
from nats.js import api

from gpupool.eventlog.credentials import READER, connect_options
from gpupool.eventlog.named_replay import named_replay
from gpupool.eventlog.port import Entry, read_entries
from gpupool.eventlog.subjects import DEFAULT_SUBJECT_PREFIX

DEFAULT_STREAM = "GPUPOOL"
BUFFER = 4096
"""Entries buffered between the subscription and the reader (flow control holds the rest)."""

logger = logging.getLogger(__name__)


class StreamMissing(LookupError):
    """The stream does not exist (a read-only reader does not create it)."""


async def _connection_error(error: Exception) -> None:
    logger.debug("NATS connection error: %r", error)


class RawMessage(msgspec.Struct, frozen=True, kw_only=True):
    """One stream message as stored: its sequence, subject, headers, bytes and stream time."""

    seq: int
    subject: str
    data: bytes
    headers: dict[str, str] = {}
    time: datetime | None = None


class ReadOnlyLog:
    def __init__(
        self, nc: Any, *, stream: str, subject_prefix: str, consumer_base: str | None = None
    ) -> None:
        self._nc = nc
        self.consumer_base = consumer_base
        """With a credential: the user whose own replay consumers it reads through."""
        self._js = nc.jetstream()
        self.stream = stream
        self.subject_prefix = subject_prefix

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        stream: str = DEFAULT_STREAM,
        subject_prefix: str = DEFAULT_SUBJECT_PREFIX,
        credentials: Path | None = None,
        tls_ca: Path | None = None,
        name: str = "gpupool-reader",
        connect_timeout: float = 10.0,
        user: str = READER,
    ) -> Self:
        """``user``: the NATS user the credential is of (its own replay consumers are read
        through when the server has permissions)."""
        options: dict[str, Any] = {
            "name": name,
            "max_reconnect_attempts": -1,
            "error_cb": _connection_error,  # one line, not nats-py's traceback per attempt
        }
        options.update(connect_options(credentials, tls_ca))
        try:
            async with asyncio.timeout(connect_timeout):
                nc = await nats.connect(url, connect_timeout=2, **options)
        except TimeoutError as exc:
            raise ConnectionError(
                f"no NATS server answered at {url} within {connect_timeout}s"
            ) from exc
        return cls(
            nc,
            stream=stream,
            subject_prefix=subject_prefix,
            # authenticated (a credential, or a user in the URL): the reader's own consumers
            consumer_base=None if credentials is None and urlsplit(url).username is None else user,
        )

    async def last_seq(self) -> int:
        try:
            info = await self._js.stream_info(self.stream)
        except nats.js.errors.NotFoundError as exc:
            raise StreamMissing(f"stream {self.stream} does not exist") from exc
        return int(info.state.last_seq)

    async def sequences(self) -> tuple[int, int]:
        """(first, last) sequence of the stream; first is last + 1 when it holds nothing
        (e.g. everything was purged)."""
        try:
            info = await self._js.stream_info(self.stream)
        except nats.js.errors.NotFoundError as exc:
            raise StreamMissing(f"stream {self.stream} does not exist") from exc
        last = int(info.state.last_seq)
        first = int(info.state.first_seq) if info.state.messages else last + 1
        return first, last

    async def entries(
        self, *, from_seq: int = 1, until_seq: int | None = None
    ) -> AsyncIterator[Entry]:
        """Entries from ``from_seq`` on, in order: up to ``until_seq``, or for ever (following).

        A decision entry yields each of its envelopes, all with the entry's sequence."""
        async for msg in self.messages(from_seq=from_seq, until_seq=until_seq):
            for entry in read_entries(msg.seq, msg.subject, msg.data):  # a decision: several
                yield entry

    async def messages(
        self, *, from_seq: int = 1, until_seq: int | None = None
    ) -> AsyncIterator[RawMessage]:
        """The stream's messages from ``from_seq`` on, as stored (the archive's input): up to
        ``until_seq``, or for ever. Sequences the stream no longer has are skipped over by
        the server: the caller checks ``seq`` if it needs them contiguous."""
        start = max(from_seq, 1)
        if until_seq is not None and until_seq < start:
            return
        if self.consumer_base is not None:  # an authenticated reader: its own replay slots
            async for msg in named_replay(
                self._nc,
                stream=self.stream,
                base=self.consumer_base,
                subject_filter=f"{self.subject_prefix}.>",
                start=start,
                until=until_seq,
            ):
                yield RawMessage(
                    seq=int(msg.metadata.sequence.stream),
                    subject=msg.subject,
                    data=bytes(msg.data),
                    headers=dict(msg.headers or {}),
                    time=msg.metadata.timestamp,
                )
            return
        buffer: asyncio.Queue[Any] = asyncio.Queue(maxsize=BUFFER)

        async def on_msg(msg: Any) -> None:
            await buffer.put(msg)

        subscription = await self._js.subscribe(
            f"{self.subject_prefix}.>",
            stream=self.stream,
            cb=on_msg,
            ordered_consumer=True,
            config=api.ConsumerConfig(
                deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start
            ),
        )
        last = start - 1
        try:
            while True:
                msg = await buffer.get()
                seq = int(msg.metadata.sequence.stream)
                if seq <= last:
                    continue  # an ordered-consumer reset may deliver an entry again
                if until_seq is not None and seq > until_seq:
                    return  # ``until_seq`` itself is not in the stream (deleted)
                last = seq
                yield RawMessage(
                    seq=seq,
                    subject=msg.subject,
                    data=bytes(msg.data),
                    headers=dict(msg.headers or {}),
                    time=msg.metadata.timestamp,
                )
                if until_seq is not None and seq >= until_seq:
                    return
        finally:
            if not self._nc.is_closed:
                # the reader is going away anyway: a failed unsubscribe changes nothing
                with contextlib.suppress(nats.errors.Error, OSError):
                    await subscription.unsubscribe()

    async def close(self) -> None:
        if not self._nc.is_closed:
            await self._nc.close()
