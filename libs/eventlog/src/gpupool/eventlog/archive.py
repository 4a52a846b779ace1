"""Archived segments of the log: the oldest entries exported to sealed, hash-chained files.

An archive is a directory. Each **segment** holds a contiguous range of stream
messages, one JSON line each (:class:`~gpupool.eventlog.reader.RawMessage`: the
sequence, subject, headers — ``Nats-Msg-Id`` among them —, the stream's time, and the
bytes as stored, base64), so every entry re-reads byte for byte, garbage included.
Each segment is **sealed** by its manifest (:class:`SegmentManifest`), written last:
first and last sequence, count, size, the segment's SHA-256, the SHA-256 of the
manifest before it (so rewriting one segment and its manifest breaks the next
manifest's link), and the checkpoint of the fold at the segment's end, with its
SHA-256. A segment without its manifest was never completed: it is not part of the
archive and the next ``archive_stream`` removes it and writes it again.

File names (sequences zero-padded to 12 digits, so they sort)::

    segment-<first>-<last>.jsonl
    segment-<first>-<last>.manifest.json
    checkpoint-<last>.snapshot

:meth:`Archive.sealed` checks the whole chain and raises a specific
:class:`ArchiveError` for a gap, a changed segment, a broken link, a missing file.
``gpupool log archive`` / ``purge`` and ``--archive DIR`` of the audit commands are
built on this module (docs/eventlog.md, "Bounds and retention").
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path

import msgspec

from gpupool.eventlog.durables import CLAIMANT
from gpupool.eventlog.port import Entry, read_entries
from gpupool.eventlog.reader import RawMessage, ReadOnlyLog

ARCHIVE_FORMAT = 1
SEGMENT_ENTRIES = 50_000
"""Messages per segment, by default."""
SEGMENT_MAX_BYTES = 64 * 1024 * 1024
"""A segment is sealed before it grows past this many bytes of message data."""
LOCK_FILE = ".lock"

_SEGMENT = re.compile(r"^segment-(\d{12})-(\d{12})\.jsonl$")
_MANIFEST = re.compile(r"^segment-(\d{12})-(\d{12})\.manifest\.json$")


class ArchiveError(Exception):
    """The archive cannot be read as one unbroken log (the message says where and why)."""


class ArchiveGap(ArchiveError):
    """Entries are missing: between two segments, or between the archive and the stream."""


class SegmentTampered(ArchiveError):
    """A sealed file's content is not what its manifest sealed."""


class ChainBroken(ArchiveError):
    """A manifest does not link to the manifest before it."""


class SegmentManifest(msgspec.Struct, frozen=True, kw_only=True):
    """The seal of one segment."""

    format: int
    stream: str
    segment: str
    first_seq: int
    last_seq: int
    count: int
    bytes: int
    sha256: str
    previous_manifest_sha256: str
    """SHA-256 of the previous segment's manifest file; "" for the first segment."""
    sealed_at: datetime
    checkpoint: str = ""
    """The checkpoint file of the fold up to ``last_seq`` ("" if none was written)."""
    checkpoint_sha256: str = ""


class Sealed(msgspec.Struct, frozen=True):
    """A sealed segment as :meth:`Archive.sealed` found it: its manifest and that file's hash."""

    manifest: SegmentManifest
    manifest_sha256: str


def segment_name(first: int, last: int) -> str:
    return f"segment-{first:012d}-{last:012d}.jsonl"


def manifest_name(first: int, last: int) -> str:
    return f"segment-{first:012d}-{last:012d}.manifest.json"


def checkpoint_name(last: int) -> str:
    return f"checkpoint-{last:012d}.snapshot"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


_record_encoder = msgspec.json.Encoder()
_record_decoder = msgspec.json.Decoder(RawMessage)
_manifest_decoder = msgspec.json.Decoder(SegmentManifest)


def encode_segment(messages: Sequence[RawMessage]) -> bytes:
    return b"".join(_record_encoder.encode(message) + b"\n" for message in messages)


def _write_atomically(path: Path, data: bytes) -> None:
    """Temporary file in the same directory, fsync, rename, fsync the directory."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


class Archive:
    """The segments in ``directory`` (created on first write)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    # ------------------------------------------------------------------ reading

    def sealed(self) -> list[Sealed]:
        """Every sealed segment, in order, after checking the chain and each file's hash.

        Raises :class:`ArchiveGap`, :class:`SegmentTampered` or :class:`ChainBroken`."""
        if not self.directory.is_dir():
            return []
        manifests = sorted(
            (int(m.group(1)), path)
            for path in self.directory.iterdir()
            if (m := _MANIFEST.match(path.name))
        )
        result: list[Sealed] = []
        previous: Sealed | None = None
        for _, path in manifests:
            raw = path.read_bytes()
            try:
                manifest = _manifest_decoder.decode(raw)
            except msgspec.DecodeError as exc:
                raise SegmentTampered(f"{path.name}: not a segment manifest: {exc}") from exc
            if manifest.format != ARCHIVE_FORMAT:
                raise ArchiveError(
                    f"{path.name}: archive format {manifest.format} is unknown "
                    f"(this gpupool reads {ARCHIVE_FORMAT})"
                )
            if manifest_name(manifest.first_seq, manifest.last_seq) != path.name or (
                manifest.segment != segment_name(manifest.first_seq, manifest.last_seq)
            ):
                raise SegmentTampered(
                    f"{path.name}: names segment {manifest.segment} of sequences "
                    f"{manifest.first_seq}..{manifest.last_seq}, not its own"
                )
            expected_first = 1 if previous is None else previous.manifest.last_seq + 1
            if manifest.first_seq > expected_first:
                raise ArchiveGap(
                    f"{manifest.segment} starts at sequence {manifest.first_seq}, but "
                    + (
                        "the archive has nothing before it"
                        if previous is None
                        else f"{previous.manifest.segment} ends at {previous.manifest.last_seq}"
                    )
                    + f": entries {expected_first}..{manifest.first_seq - 1} are missing"
                )
            if manifest.first_seq < expected_first:
                assert previous is not None
                raise ChainBroken(
                    f"{manifest.segment} starts at sequence {manifest.first_seq}, inside "
                    f"{previous.manifest.segment} (which ends at {previous.manifest.last_seq})"
                )
            link = "" if previous is None else previous.manifest_sha256
            if manifest.previous_manifest_sha256 != link:
                raise ChainBroken(
                    f"{path.name} links to a previous manifest of sha256 "
                    f"{manifest.previous_manifest_sha256 or '(none)'}, but "
                    + (
                        "it is the first segment"
                        if previous is None
                        else f"{manifest_name(previous.manifest.first_seq, previous.manifest.last_seq)}"
                        f" hashes to {link}: a manifest was rewritten"
                    )
                )
            self._check_file(manifest.segment, manifest.sha256, manifest.segment)
            if manifest.checkpoint:
                self._check_file(manifest.checkpoint, manifest.checkpoint_sha256, manifest.segment)
            previous = Sealed(manifest, _sha256(raw))
            result.append(previous)
        return result

    def _check_file(self, name: str, sealed_sha256: str, segment: str) -> None:
        path = self.directory / name
        try:
            data = path.read_bytes()
        except FileNotFoundError as exc:
            raise ArchiveGap(f"{name} is missing (sealed by the manifest of {segment})") from exc
        actual = _sha256(data)
        if actual != sealed_sha256:
            raise SegmentTampered(
                f"{name}: its sha256 is {actual}, but it was sealed as {sealed_sha256}: "
                "the file changed after it was archived"
            )

    @property
    def last_seq(self) -> int:
        """The last sequence sealed (0: an empty archive); checks the chain."""
        sealed = self.sealed()
        return sealed[-1].manifest.last_seq if sealed else 0

    def messages(self, sealed: Sequence[Sealed] | None = None) -> Iterator[RawMessage]:
        """Every archived message, in order; each segment's hash is checked again as it is read."""
        for segment in self.sealed() if sealed is None else sealed:
            manifest = segment.manifest
            data = (self.directory / manifest.segment).read_bytes()
            if _sha256(data) != manifest.sha256:
                raise SegmentTampered(
                    f"{manifest.segment}: changed while the archive was being read"
                )
            expected = manifest.first_seq
            for line in data.splitlines():
                try:
                    message = _record_decoder.decode(line)
                except msgspec.DecodeError as exc:  # sealed as it is: written by another tool
                    raise SegmentTampered(
                        f"{manifest.segment}: line {expected - manifest.first_seq + 1} is not "
                        f"an archived message: {exc}"
                    ) from exc
                if message.seq != expected:
                    raise ArchiveGap(
                        f"{manifest.segment}: sequence {message.seq} where {expected} was expected"
                    )
                expected += 1
                yield message
            if expected - 1 != manifest.last_seq:
                raise ArchiveGap(
                    f"{manifest.segment}: ends at {expected - 1}, sealed as ending at "
                    f"{manifest.last_seq}"
                )

    def entries(self, sealed: Sequence[Sealed] | None = None) -> Iterator[Entry]:
        """The archived entries as the log's readers see them (a decision: several)."""
        for message in self.messages(sealed):
            yield from read_entries(message.seq, message.subject, message.data)

    def latest_checkpoint(self, sealed: Sequence[Sealed] | None = None) -> tuple[int, bytes] | None:
        """(sequence, bytes) of the newest checkpoint, checked against its seal; None if none."""
        for segment in reversed(self.sealed() if sealed is None else sealed):
            manifest = segment.manifest
            if manifest.checkpoint:
                data = (self.directory / manifest.checkpoint).read_bytes()
                if _sha256(data) != manifest.checkpoint_sha256:
                    raise SegmentTampered(f"{manifest.checkpoint}: changed after it was sealed")
                return manifest.last_seq, data
        return None

    # ------------------------------------------------------------------ writing

    def remove_unsealed(self, sealed: Sequence[Sealed]) -> list[Path]:
        """Remove what a crash may have left: temporary files, segments and checkpoints that
        no manifest seals. Returns what was removed."""
        if not self.directory.is_dir():
            return []
        kept = {LOCK_FILE}
        for segment in sealed:
            name = manifest_name(segment.manifest.first_seq, segment.manifest.last_seq)
            kept |= {name, segment.manifest.segment, segment.manifest.checkpoint}
        removed = []
        for path in sorted(self.directory.iterdir()):
            ours = (
                _SEGMENT.match(path.name)
                or _MANIFEST.match(path.name)
                or path.name.startswith("checkpoint-")
                or (path.name.startswith(".") and path.name.endswith(".tmp"))
            )
            if ours and path.name not in kept and path.is_file():
                path.unlink()
                removed.append(path)
        return removed

    def seal(
        self,
        messages: Sequence[RawMessage],
        *,
        stream: str,
        previous: Sealed | None,
        checkpoint: bytes | None = None,
    ) -> Sealed:
        """Write one segment, its checkpoint, then its manifest (the seal), each atomically."""
        first, last = messages[0].seq, messages[-1].seq
        if [m.seq for m in messages] != list(range(first, last + 1)):
            raise ArchiveGap(f"messages {first}..{last} are not contiguous")
        expected_first = 1 if previous is None else previous.manifest.last_seq + 1
        if first != expected_first:
            raise ArchiveGap(
                f"a segment from {first} cannot follow the archive's {expected_first - 1}"
            )
        self.directory.mkdir(parents=True, exist_ok=True)
        data = encode_segment(messages)
        segment = segment_name(first, last)
        _write_atomically(self.directory / segment, data)
        checkpoint_file = checkpoint_sha = ""
        if checkpoint is not None:
            checkpoint_file = checkpoint_name(last)
            checkpoint_sha = _sha256(checkpoint)
            _write_atomically(self.directory / checkpoint_file, checkpoint)
        manifest = SegmentManifest(
            format=ARCHIVE_FORMAT,
            stream=stream,
            segment=segment,
            first_seq=first,
            last_seq=last,
            count=len(messages),
            bytes=len(data),
            sha256=_sha256(data),
            previous_manifest_sha256="" if previous is None else previous.manifest_sha256,
            sealed_at=datetime.now(UTC),
            checkpoint=checkpoint_file,
            checkpoint_sha256=checkpoint_sha,
        )
        raw = msgspec.json.format(msgspec.json.encode(manifest), indent=2) + b"\n"
        _write_atomically(self.directory / manifest_name(first, last), raw)
        return Sealed(manifest, _sha256(raw))

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the archive's lock (one writer at a time); raises ArchiveError if it is held."""
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                raise ArchiveError(
                    f"{self.directory}: another `gpupool log archive` is writing this archive"
                ) from exc
            yield
        finally:
            os.close(fd)


Checkpointer = Callable[[Sequence[RawMessage]], bytes]
"""Folds one segment's messages (after every earlier one) and returns the checkpoint's bytes."""


class ArchiveRun(msgspec.Struct, frozen=True, kw_only=True):
    """What one ``archive_stream`` did."""

    sealed: list[SegmentManifest]
    removed: list[str]
    """Unsealed leftovers of an interrupted run, removed."""
    last_seq: int
    """The archive's last sequence afterwards."""


async def stream_messages(
    log: ReadOnlyLog, *, from_seq: int, until_seq: int
) -> AsyncIterator[RawMessage]:
    """The stream's messages ``from_seq..until_seq``, which must all be there: a sequence
    the stream no longer has (purged, deleted) is an :class:`ArchiveGap`."""
    if until_seq < from_seq:
        return
    expected = from_seq
    async for message in log.messages(from_seq=from_seq, until_seq=until_seq):
        if message.seq != expected:
            raise ArchiveGap(
                f"stream {log.stream} has no entry {expected} (deleted or purged): "
                f"entries {expected}..{message.seq - 1} cannot be archived"
            )
        expected += 1
        yield message
    if expected - 1 != until_seq:
        raise ArchiveGap(f"stream {log.stream} has no entry {expected}: the archive stops at it")


async def archive_stream(
    log: ReadOnlyLog,
    archive: Archive,
    *,
    up_to: int | None = None,
    segment_entries: int = SEGMENT_ENTRIES,
    checkpointer: Callable[[Sequence[Sealed]], Checkpointer] | None = None,
) -> ArchiveRun:
    """Export the stream's entries after the archive's last one, up to ``up_to`` (default: the
    stream's last), into sealed segments. Idempotent: run again, it continues where the last
    sealed segment ends; what an interrupted run left unsealed is removed and written again.

    ``checkpointer(sealed)`` is given the archive's sealed segments and returns the function
    that folds each new segment and gives its checkpoint (``gpupool.runtime.checkpoint``)."""
    if segment_entries < 1:
        raise ValueError("a segment holds at least one entry")
    with archive.locked():
        sealed = archive.sealed()
        removed = archive.remove_unsealed(sealed)
        previous = sealed[-1] if sealed else None
        start = 1 if previous is None else previous.manifest.last_seq + 1
        first, last = await log.sequences()
        target = last if up_to is None else up_to
        if target > last:
            raise ArchiveError(
                f"stream {log.stream} ends at sequence {last}: cannot archive up to {target}"
            )
        new: list[SegmentManifest] = []
        if target >= start:
            if first > start:
                raise ArchiveGap(
                    f"stream {log.stream} starts at sequence {first} and the archive ends at "
                    f"{start - 1}: entries {start}..{first - 1} were purged without being archived"
                )
            checkpoint = None if checkpointer is None else checkpointer(sealed)
            batch: list[RawMessage] = []
            size = 0

            def close_segment() -> None:
                nonlocal previous, batch, size
                data = None if checkpoint is None else checkpoint(batch)
                previous = archive.seal(
                    batch, stream=log.stream, previous=previous, checkpoint=data
                )
                new.append(previous.manifest)
                batch, size = [], 0

            async for message in stream_messages(log, from_seq=start, until_seq=target):
                if batch and size + len(message.data) > SEGMENT_MAX_BYTES:
                    close_segment()
                batch.append(message)
                size += len(message.data)
                if len(batch) >= segment_entries:
                    close_segment()
            if batch:
                close_segment()
        return ArchiveRun(
            sealed=new,
            removed=[path.name for path in removed],
            last_seq=previous.manifest.last_seq if previous is not None else 0,
        )


# ---------------------------------------------------------------------- the purge rule


class PurgeRefused(Exception):
    """A purge up to this sequence would leave a reader without a start (the message says which)."""


class ReaderStart(msgspec.Struct, frozen=True):
    """A reader of the stream and the last sequence it can start past (its snapshot's)."""

    name: str
    last_seq: int


def check_purge(
    up_to: int,
    *,
    archive_last: int,
    checkpoints: Sequence[int],
    stream_first: int,
    stream_last: int,
    durables: Sequence[str],
    snapshots: Sequence[ReaderStart],
) -> int:
    """The rule: a purge up to ``up_to`` is safe only if every reader can start past it.

    * the archive holds every entry up to ``up_to`` (``archive_last >= up_to``), and it ends a
      sealed segment with a checkpoint there, so the fold at the cut is kept (a new replica,
      ``verify`` and rebuilds start from the checkpoint or read archive + stream);
    * every durable consumer of the stream (a service instance: ``<service>-<instance>``)
      has a snapshot given, and every snapshot given has ``last_seq >= up_to`` (its service
      restarts past the cut);
    * no snapshot covers more than the stream has (it would be of another stream).

    Returns the number of entries the purge removes; raises :class:`PurgeRefused`."""
    if up_to < 1:
        raise PurgeRefused(f"--up-to {up_to}: a purge removes sequences 1..N, N >= 1")
    if up_to > stream_last:
        raise PurgeRefused(f"the stream ends at sequence {stream_last}: cannot purge up to {up_to}")
    if up_to < stream_first:
        raise PurgeRefused(
            f"the stream starts at sequence {stream_first}: everything up to {up_to} is gone already"
        )
    if up_to > archive_last:
        raise PurgeRefused(
            f"the archive ends at sequence {archive_last}: entries {archive_last + 1}..{up_to} "
            "are not archived (run `gpupool log archive` first)"
        )
    if up_to not in checkpoints:
        ends = ", ".join(str(seq) for seq in checkpoints[-5:]) or "none"
        raise PurgeRefused(
            f"sequence {up_to} does not end an archived segment with a checkpoint "
            f"(the last ones: {ends}); archive with --up-to {up_to} to cut there"
        )
    known = {snapshot.name: snapshot for snapshot in snapshots}
    for snapshot in snapshots:
        if snapshot.last_seq > stream_last:
            raise PurgeRefused(
                f"snapshot {snapshot.name} covers sequence {snapshot.last_seq}, past the stream's "
                f"last {stream_last}: it is of another stream"
            )
    missing = [name for name in durables if name not in known]
    if missing:
        raise PurgeRefused(
            "no snapshot given for the durable consumer(s) "
            + ", ".join(sorted(missing))
            + ": each service instance must have a snapshot past the cut "
            "(<snapshot-dir>/<service>-<instance>.snapshot; --snapshot FILE)"
        )
    behind = sorted(
        (s for s in snapshots if s.last_seq < up_to),
        key=lambda s: s.last_seq,
    )
    if behind:
        raise PurgeRefused(
            "these readers could not start past the cut: "
            + ", ".join(f"{s.name}'s snapshot covers only up to {s.last_seq}" for s in behind)
            + f"; the safe bound is {min(archive_last, behind[0].last_seq)}"
        )
    return up_to - stream_first + 1


class StreamOperator(ReadOnlyLog):
    """The operator's connection (the ``operator`` credential): reads like a reader, lists the
    stream's durable consumers, and purges. Nothing else of the stream changes."""

    async def durables(self) -> list[str]:
        """The service instances holding a durable consumer of the stream, each named as its
        snapshot is (``<service>-<instance>``; :func:`durable_reader`), each once (an instance
        may hold a second slot for a while: the one it left behind after a rebuild, until it
        expires)."""
        infos = await self._js.consumers_info(self.stream)
        return sorted(
            {
                durable_reader(info.config.durable_name, (info.config.metadata or {}).get(CLAIMANT))
                for info in infos
                if info.config.durable_name
            }
        )

    async def message(self, seq: int) -> tuple[str, bytes]:
        """(subject, bytes) of the stream's message ``seq``."""
        raw = await self._js.get_msg(self.stream, seq)
        return str(raw.subject), bytes(raw.data or b"")

    async def purge_through(self, seq: int) -> None:
        """Remove every message up to and including ``seq`` (JetStream keeps ``seq + 1`` on)."""
        await self._js.purge_stream(self.stream, seq=seq + 1)


def durable_reader(durable: str, claimant: str | None) -> str:
    """The reader a durable consumer stands for, named as its snapshot file is.

    A service replica claims one of its NATS user's durable slots ``<user>-<slot>``
    (gpupool.eventlog.durables) and names itself (its ``--instance``) in the slot's
    metadata; its snapshot is ``<service>-<instance>.snapshot``, where the service is the
    user's writer (``node-executor-<node>`` is a node-executor). A durable without a
    claimant (made before the slots) stands for itself."""
    if claimant is None:
        return durable
    user = durable.rsplit("-", 1)[0]
    service = "node-executor" if user.startswith("node-executor-") else user
    return f"{service}-{claimant}"


def archived_message(archive: Archive, sealed: Sequence[Sealed], seq: int) -> RawMessage:
    """The archived message ``seq`` (read from the one segment holding it)."""
    for segment in sealed:
        if segment.manifest.first_seq <= seq <= segment.manifest.last_seq:
            for message in archive.messages([segment]):
                if message.seq == seq:
                    return message
    raise ArchiveGap(f"the archive holds no entry {seq}")
