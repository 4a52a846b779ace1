"""Where the audit commands read the event log from: a JSON-lines file or live JetStream.

``--log FILE.jsonl`` reads what ``gpupool simulate`` writes (one envelope per
line; an entry's sequence is its ordinal, the line number when no line is blank). ``--nats URL [--stream NAME]``
reads the stream read-only through :class:`~gpupool.eventlog.reader.ReadOnlyLog`;
with ``--archive DIR`` the archive's sealed segments (``gpupool log archive``) come
first and the stream follows after the archive's last entry, as one log (a stream
purged past the archive, a gap or a changed segment is an error saying which).
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
        "--archive",
        type=Path,
        metavar="DIR",
        help="with the stream: read this archive's sealed segments first (`gpupool log "
        "archive`), then the stream after them, as one log (needed once the stream was purged)",
    )
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
    archive = getattr(args, "archive", None)
    if archive is not None and args.log is not None:
        raise InvalidInput("--archive goes with the stream (--nats), not with --log FILE")
    resolve_log_source(args)
    if args.log is not None:
        return FileLogSource(args.log, subject_prefix=args.subject_prefix)
    stream = await NatsLogSource.connect(
        args.nats, stream=args.stream, subject_prefix=args.subject_prefix
    )
    if archive is None:
        return stream
    if not archive.is_dir():
        await stream.close()
        raise InvalidInput(f"{archive}: no such archive directory")
    return ArchivedLogSource(archive, stream)


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
    async def connect(
        cls,
        url: str,
        *,
        stream: str,
        subject_prefix: str,
        credentials: Path | None = None,
        ca: Path | None = None,
    ) -> NatsLogSource:
        """Credentials and CA: the arguments, else $GPUPOOL_NATS_CREDENTIALS / $GPUPOOL_NATS_CA."""
        from gpupool.eventlog.reader import ReadOnlyLog, StreamMissing

        credentials = credentials or _env_path("GPUPOOL_NATS_CREDENTIALS")
        ca = ca or _env_path("GPUPOOL_NATS_CA")
        try:
            log = await ReadOnlyLog.connect(
                url,
                stream=stream,
                subject_prefix=subject_prefix,
                name="gpupool-cli",
                credentials=credentials,
                tls_ca=ca,
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
        """Every entry up to the stream's last sequence when the reading starts; a stream
        purged of its first entries is refused (a fold of its tail alone would be wrong)."""
        first, _ = await self.log.sequences()
        if first > 1:
            raise CommandFailed(
                f"{self.description} starts at sequence {first}: entries 1..{first - 1} were "
                "purged; read the log with --archive DIR (the archive they were exported to)"
            )
        async for entry in self.tail(1):
            yield entry

    async def tail(self, from_seq: int) -> AsyncIterator[Entry]:
        """The entries from ``from_seq`` to the stream's last sequence when the reading starts."""
        first, last = await self.log.sequences()
        if max(from_seq, first) > last:
            return
        async for entry in self.log.entries(from_seq=from_seq, until_seq=last):
            yield entry

    async def follow(self, after_seq: int) -> AsyncIterator[Entry]:
        """Entries after ``after_seq``, pushed by the server as they are appended."""
        async for entry in self.log.entries(from_seq=after_seq + 1):
            yield entry

    async def close(self) -> None:
        await self.log.close()


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value) if value else None


# --------------------------------------------------------------------------- archive + stream


class ArchivedLogSource:
    """An archive's sealed segments, then the stream after the archive's last entry: one log.

    The archive's chain is checked before anything is read (a gap, a changed segment or a
    broken link is a :class:`CommandFailed` naming the file); the stream must start at or
    before the entry after the archive (else the entries between are in neither)."""

    def __init__(self, directory: Path, stream: NatsLogSource) -> None:
        from gpupool.eventlog.archive import Archive

        self.archive = Archive(directory)
        self.stream = stream

    @property
    def description(self) -> str:
        return f"archive {self.archive.directory} + {self.stream.description}"

    async def entries(self) -> AsyncIterator[Entry]:
        from gpupool.eventlog.archive import ArchiveError

        try:
            sealed = self.archive.sealed()
        except (ArchiveError, OSError) as exc:
            raise CommandFailed(f"archive {self.archive.directory}: {exc}") from exc
        archived = sealed[-1].manifest.last_seq if sealed else 0
        first, _ = await self.stream.log.sequences()
        if first > archived + 1:
            raise CommandFailed(
                f"{self.stream.description} starts at sequence {first} and archive "
                f"{self.archive.directory} ends at {archived}: entries {archived + 1}.."
                f"{first - 1} are in neither"
            )
        try:
            for entry in self.archive.entries(sealed):
                yield entry
        except (ArchiveError, OSError) as exc:
            raise CommandFailed(f"archive {self.archive.directory}: {exc}") from exc
        async for entry in self.stream.tail(archived + 1):
            yield entry

    def follow(self, after_seq: int) -> AsyncIterator[Entry]:
        return self.stream.follow(after_seq)

    async def close(self) -> None:
        await self.stream.close()
