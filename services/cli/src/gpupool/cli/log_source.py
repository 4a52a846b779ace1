"""Where the audit commands read the event log from: a JSON-lines file or live JetStream.

``--log FILE.jsonl`` reads what ``gpupool simulate`` writes (one envelope per
line; an entry's sequence is its ordinal, the line number when no line is blank). ``--nats URL [--stream NAME]``
reads the stream read-only through :class:`~gpupool.eventlog.reader.ReadOnlyLog`.
Either way the commands get the same :data:`~gpupool.eventlog.port.Entry` values.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TextIO

from gpupool.cli.exits import CommandFailed, InvalidInput
from gpupool.cli.stack_address import find_nats_url
from gpupool.eventlog.port import Entry, StoredEvent, read_entry
from gpupool.eventlog.subjects import DEFAULT_SUBJECT_PREFIX, SIMULATOR_WRITER, subject_for

if TYPE_CHECKING:
    from gpupool.eventlog.reader import ReadOnlyLog

DEFAULT_STREAM = "GPUPOOL"
PROGRESS_EVERY = 10_000
"""Entries between two progress reports on stderr."""
FOLLOW_POLL_S = 0.5
"""How often ``--follow`` looks for new entries."""


class LogSource(Protocol):
    """An event log the audit commands can read once and then follow."""

    @property
    def description(self) -> str: ...

    def entries(self) -> AsyncIterator[Entry]:
        """Every entry present now, in order."""
        ...

    def follow(self, after_seq: int) -> AsyncIterator[Entry]:
        """Entries after ``after_seq`` as they arrive; never ends by itself."""
        ...

    async def close(self) -> None: ...


def add_log_source_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_argument_group(
        "log source (one of; default: $GPUPOOL_NATS_URL, else the running `gpupool up`)"
    )
    choice = source.add_mutually_exclusive_group()
    choice.add_argument(
        "--log", type=Path, metavar="FILE", help="a JSON-lines log (the output of simulate)"
    )
    choice.add_argument("--nats", metavar="URL", help="a live JetStream log, e.g. nats://host:4222")
    source.add_argument(
        "--stream", default=DEFAULT_STREAM, help=f"JetStream stream (default {DEFAULT_STREAM})"
    )
    source.add_argument(
        "--subject-prefix",
        default=DEFAULT_SUBJECT_PREFIX,
        help=f"subjects of the log (default {DEFAULT_SUBJECT_PREFIX})",
    )
    source.add_argument(
        "--progress",
        action="store_true",
        help="report reading progress on stderr (always on when stderr is a terminal)",
    )
    source.add_argument(
        "--progress-every",
        type=int,
        default=PROGRESS_EVERY,
        metavar="N",
        help=f"entries between progress reports (default {PROGRESS_EVERY})",
    )


def resolve_log_source(args: argparse.Namespace) -> None:
    """Without --log or --nats: the NATS of $GPUPOOL_NATS_URL or of a running ``gpupool up``."""
    if args.log is not None or args.nats is not None:
        return
    found = find_nats_url()
    if found is None:
        raise InvalidInput(
            "no log to read: give --log FILE or --nats URL, set GPUPOOL_NATS_URL, "
            "or start the stack with `gpupool up`"
        )
    args.nats = found[0]


async def open_log_source(args: argparse.Namespace) -> LogSource:
    resolve_log_source(args)
    if args.log is not None:
        return FileLogSource(args.log, subject_prefix=args.subject_prefix)
    return await NatsLogSource.connect(
        args.nats, stream=args.stream, subject_prefix=args.subject_prefix
    )


async def read_log(args: argparse.Namespace) -> list[Entry]:
    """Open the source the arguments name and read all of it (with progress on stderr)."""
    source = await open_log_source(args)
    try:
        return await read_entries(source, progress=progress_for(args))
    finally:
        await source.close()


async def read_entries(source: LogSource, *, progress: Progress | None = None) -> list[Entry]:
    entries: list[Entry] = []
    async for entry in source.entries():
        entries.append(entry)
        if progress is not None:
            progress.tick(len(entries))
    if progress is not None:
        progress.finish(len(entries))
    return entries


class Progress:
    """A counter on stderr every ``every`` entries: rewritten in place on a terminal."""

    def __init__(self, stream: TextIO, every: int, what: str) -> None:
        self.stream = stream
        self.every = max(1, every)
        self.what = what
        self.in_place = stream.isatty()
        self._shown = False

    def tick(self, count: int) -> None:
        if count % self.every == 0:
            self._show(count)

    def finish(self, count: int) -> None:
        if self._shown:
            self._show(count, done=True)

    def _show(self, count: int, *, done: bool = False) -> None:
        text = f"{self.what}: {count} entries" + (", done" if done else "")
        if self.in_place:
            self.stream.write("\r" + text + ("\n" if done else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        self._shown = True


def progress_for(args: argparse.Namespace) -> Progress | None:
    stream = sys.stderr
    if not (args.progress or stream.isatty()):
        return None
    return Progress(stream, args.progress_every, f"reading {_source_name(args)}")


def _source_name(args: argparse.Namespace) -> str:
    return str(args.log) if args.log is not None else f"{args.nats} stream {args.stream}"


# --------------------------------------------------------------------------- a JSON-lines file


def file_entry(seq: int, line: bytes, *, subject_prefix: str) -> Entry:
    """One line of a JSON-lines log as an entry with sequence ``seq``.

    The subject is the one the event would have in JetStream; an unreadable line has none.
    """
    data = line.rstrip(b"\r\n")
    entry = read_entry(seq, "", data)
    if isinstance(entry, StoredEvent):
        try:
            subject = subject_for(
                entry.envelope.event, prefix=subject_prefix, writer=SIMULATOR_WRITER
            )
        except ValueError:
            return entry
        return StoredEvent(seq=seq, subject=subject, envelope=entry.envelope)
    return entry


class FileLogSource:
    def __init__(self, path: Path, *, subject_prefix: str = DEFAULT_SUBJECT_PREFIX) -> None:
        if not path.is_file():
            raise InvalidInput(f"{path}: no such log file")
        self.path = path
        self.subject_prefix = subject_prefix

    @property
    def description(self) -> str:
        return str(self.path)

    async def entries(self) -> AsyncIterator[Entry]:
        try:
            with self.path.open("rb") as handle:
                number = 0
                for line in handle:
                    if line.strip():
                        number += 1
                        yield file_entry(number, line, subject_prefix=self.subject_prefix)
        except OSError as exc:
            raise InvalidInput(f"{self.path}: cannot read: {exc.strerror or exc}") from exc

    async def follow(self, after_seq: int) -> AsyncIterator[Entry]:
        """Entries after entry ``after_seq``, as lines are appended (a partial last line waits)."""
        number = 0
        pending = b""
        with self.path.open("rb") as handle:
            while True:
                chunk = handle.readline()
                if not chunk:
                    await asyncio.sleep(FOLLOW_POLL_S)
                    continue
                pending += chunk
                if not pending.endswith(b"\n"):
                    continue
                line, pending = pending, b""
                if not line.strip():
                    continue
                number += 1
                if number > after_seq:
                    yield file_entry(number, line, subject_prefix=self.subject_prefix)

    async def close(self) -> None:
        return None


# --------------------------------------------------------------------------- JetStream


class NatsLogSource:
    """JetStream, read-only (``ReadOnlyLog``: ordered consumers, no stream or durable created,
    nothing published); imported only when asked for (reading a file needs no NATS client)."""

    def __init__(self, log: ReadOnlyLog, url: str, stream: str) -> None:
        self.log = log
        self.url = url
        self.stream = stream

    @classmethod
    async def connect(cls, url: str, *, stream: str, subject_prefix: str) -> NatsLogSource:
        from gpupool.eventlog.reader import ReadOnlyLog, StreamMissing

        credentials, ca = (
            os.environ.get("GPUPOOL_NATS_CREDENTIALS"),
            os.environ.get("GPUPOOL_NATS_CA"),
        )
        try:
            log = await ReadOnlyLog.connect(
                url,
                stream=stream,
                subject_prefix=subject_prefix,
                name="gpupool-cli",
                credentials=Path(credentials) if credentials else None,
                tls_ca=Path(ca) if ca else None,
            )
        except (ConnectionError, OSError, TimeoutError) as exc:
            raise CommandFailed(f"{url}: cannot open stream {stream}: {exc}") from exc
        try:
            await log.last_seq()
        except StreamMissing as exc:
            await log.close()
            raise CommandFailed(f"{url}: cannot open stream {stream}: {exc}") from exc
        return cls(log, url, stream)

    @property
    def description(self) -> str:
        return f"{self.url} stream {self.stream}"

    async def entries(self) -> AsyncIterator[Entry]:
        """Every entry up to the stream's last sequence when the reading starts."""
        last = await self.log.last_seq()
        async for entry in self.log.entries(until_seq=last):
            yield entry

    async def follow(self, after_seq: int) -> AsyncIterator[Entry]:
        """Entries after ``after_seq``, pushed by the server as they are appended."""
        async for entry in self.log.entries(from_seq=after_seq + 1):
            yield entry

    async def close(self) -> None:
        await self.log.close()
