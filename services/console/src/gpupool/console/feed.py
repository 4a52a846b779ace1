"""The console's copy of the log: every entry read so far, kept in order, and a signal that
wakes the live pages when one arrives.

Two sources, both read-only:

* :class:`NatsFeed` follows the JetStream stream from its first entry through
  :class:`~gpupool.eventlog.reader.ReadOnlyLog` (an *ordered consumer*: the server
  pushes each entry as it is appended, no polling); the console never creates a
  stream or a durable consumer, nor publishes anything. It needs a credential that
  may read the stream (stream info and an ephemeral consumer); see docs/console.md.
* :class:`FileFeed` reads a JSON-lines log (what ``gpupool simulate`` writes) once:
  for looking at a past run offline.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from gpupool.eventlog.port import Entry, StoredEvent, read_entry
from gpupool.eventlog.reader import DEFAULT_STREAM, ReadOnlyLog
from gpupool.eventlog.subjects import DEFAULT_SUBJECT_PREFIX, SIMULATOR_WRITER, subject_for

__all__ = ["DEFAULT_STREAM", "FileFeed", "LogFeed", "NatsFeed"]


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
                    subject = subject_for(
                        entry.envelope.event,
                        prefix=self.subject_prefix,
                        writer=SIMULATOR_WRITER,
                    )
                    entry = StoredEvent(seq=number, subject=subject, envelope=entry.envelope)
            entries.append(entry)
        await self.add(entries)


class NatsFeed(LogFeed):
    """Follow ``stream`` from its first entry, read-only (``ReadOnlyLog``'s ordered consumer)."""

    BATCH_S = 0.05
    """Entries arriving within this long of each other wake the pages once."""

    def __init__(
        self,
        url: str,
        *,
        stream: str = DEFAULT_STREAM,
        subject_prefix: str = DEFAULT_SUBJECT_PREFIX,
        credentials: Path | None = None,
        tls_ca: Path | None = None,
    ) -> None:
        super().__init__()
        self.tls_ca = tls_ca
        self.url = url
        self.stream = stream
        self.subject_prefix = subject_prefix
        self.credentials = credentials
        self.description = f"{url} stream {stream}"
        self._log: ReadOnlyLog | None = None
        self._arrived: asyncio.Queue[Entry] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self._log = await ReadOnlyLog.connect(
            self.url,
            stream=self.stream,
            subject_prefix=self.subject_prefix,
            credentials=self.credentials,
            tls_ca=self.tls_ca,
            name="gpupool-console",
        )
        self._tasks = [
            asyncio.create_task(self._read(self._log)),
            asyncio.create_task(self._publish()),
        ]

    async def _read(self, log: ReadOnlyLog) -> None:
        async for entry in log.entries():
            await self._arrived.put(entry)

    async def _publish(self) -> None:
        while True:
            batch = [await self._arrived.get()]
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.BATCH_S):
                    while True:
                        batch.append(await self._arrived.get())
            await self.add(batch)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._log is not None:
            await self._log.close()
