"""The console's copy of the log: every entry read so far, kept in order, and a signal that
wakes the live pages when one arrives.

Two sources, both read-only:

* :class:`NatsFeed` follows the JetStream stream with an *ordered consumer* from its
  first entry: the server pushes each entry as it is appended (no polling), and the
  console never creates a stream or a durable consumer, nor publishes anything. It
  needs a credential that may read the stream (stream info and an ephemeral
  consumer); see docs/console.md.
* :class:`FileFeed` reads a JSON-lines log (what ``gpupool simulate`` writes) once:
  for looking at a past run offline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

from gpupool.eventlog.port import Entry, StoredEvent, read_entry
from gpupool.eventlog.subjects import DEFAULT_SUBJECT_PREFIX, subject_for

logger = logging.getLogger(__name__)

DEFAULT_STREAM = "GPUPOOL"


class LogFeed:
    """Entries in log order and a version counter the live pages wait on."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.version = 0
        self._changed = asyncio.Condition()
        self.description = ""

    async def add(self, entries: list[Entry]) -> None:
        if not entries:
            return
        self.entries.extend(entries)
        async with self._changed:
            self.version += 1
            self._changed.notify_all()

    async def wait_after(self, version: int) -> int:
        """Wait until the feed has moved past ``version``; return the new version."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.version > version)
            return self.version

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None


class FileFeed(LogFeed):
    def __init__(self, path: Path, *, subject_prefix: str = DEFAULT_SUBJECT_PREFIX) -> None:
        super().__init__()
        self.path = path
        self.subject_prefix = subject_prefix
        self.description = str(path)

    async def start(self) -> None:
        entries: list[Entry] = []
        for number, line in enumerate(
            (line for line in self.path.read_bytes().splitlines() if line.strip()), start=1
        ):
            entry = read_entry(number, "", line)
            if isinstance(entry, StoredEvent):
                with contextlib.suppress(ValueError):
                    subject = subject_for(entry.envelope.event, prefix=self.subject_prefix)
                    entry = StoredEvent(seq=number, subject=subject, envelope=entry.envelope)
            entries.append(entry)
        await self.add(entries)


class NatsFeed(LogFeed):
    """Follow ``stream`` from its first entry with an ordered push consumer."""

    BATCH_S = 0.05
    """Entries arriving within this long of each other wake the pages once."""

    def __init__(
        self,
        url: str,
        *,
        stream: str = DEFAULT_STREAM,
        subject_prefix: str = DEFAULT_SUBJECT_PREFIX,
        credentials: Path | None = None,
    ) -> None:
        super().__init__()
        self.url = url
        self.stream = stream
        self.subject_prefix = subject_prefix
        self.credentials = credentials
        self.description = f"{url} stream {stream}"
        self._nc: Any = None
        self._subscription: Any = None
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._pump: asyncio.Task[None] | None = None
        self._last_seq = 0

    async def start(self) -> None:
        import nats
        from nats.js import api

        options: dict[str, Any] = {"name": "gpupool-console", "max_reconnect_attempts": -1}
        if self.credentials is not None:
            options["user_credentials"] = str(self.credentials)
        self._nc = await nats.connect(self.url, **options)
        js = self._nc.jetstream()

        async def on_msg(msg: Any) -> None:
            await self._queue.put(msg)

        self._subscription = await js.subscribe(
            f"{self.subject_prefix}.>",
            stream=self.stream,
            cb=on_msg,
            ordered_consumer=True,
            config=api.ConsumerConfig(deliver_policy=api.DeliverPolicy.ALL),
        )
        self._pump = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.BATCH_S):
                    while True:
                        batch.append(await self._queue.get())
            entries = []
            for msg in batch:
                seq = msg.metadata.sequence.stream
                if seq <= self._last_seq:
                    continue  # an ordered-consumer reset may deliver an entry again
                self._last_seq = seq
                entries.append(read_entry(seq, msg.subject, msg.data))
            await self.add(entries)

    async def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump
        if self._nc is not None and not self._nc.is_closed:
            await self._nc.close()
