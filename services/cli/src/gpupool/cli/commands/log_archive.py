"""``gpupool log archive`` and ``gpupool log purge``: the retention of the append-only log.

``archive --to DIR [--up-to SEQ]`` exports the stream's entries after the archive's last
one into sealed, hash-chained segments, each with the checkpoint of the fold at its end
(:mod:`gpupool.eventlog.archive`, :mod:`gpupool.runtime.checkpoint`); run again, it
continues. ``purge --archive DIR --up-to SEQ --snapshot-dir DIR...`` removes the stream's
entries up to SEQ, only if every reader can start past it (``check_purge``), with the
``operator`` credential (no service credential may purge). docs/eventlog.md, "Bounds and
retention", gives the procedure.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from gpupool.cli.exits import EXIT_OK, CommandFailed, InvalidInput
from gpupool.cli.log_source import DEFAULT_STREAM
from gpupool.cli.stack_address import find_nats_url
from gpupool.eventlog.subjects import DEFAULT_SUBJECT_PREFIX

if TYPE_CHECKING:
    from gpupool.cli.main import Subparsers
    from gpupool.eventlog.archive import StreamOperator


def register_actions(subparsers: Subparsers) -> None:
    archive = subparsers.add_parser(
        "archive",
        help="export the oldest entries into sealed segment files (resumable)",
        description="Export the stream's entries after the archive's last one (up to --up-to, "
        "default the stream's last) into DIR: segment-<first>-<last>.jsonl (each entry as "
        "stored: sequence, subject, headers, bytes), sealed by its .manifest.json (count, "
        "sha256, the previous manifest's sha256) and checkpoint-<last>.snapshot (the fold "
        "at the segment's end). Run again, it continues where the archive ends; what an "
        "interrupted run left unsealed is written again.",
    )
    _connection_arguments(archive)
    archive.add_argument("--to", type=Path, required=True, metavar="DIR", help="the archive")
    archive.add_argument(
        "--up-to", type=int, metavar="SEQ", help="the last sequence to archive (a purge's cut)"
    )
    archive.add_argument(
        "--segment-entries",
        type=int,
        default=None,
        metavar="N",
        help="entries per segment (default 50000; a segment also stops before 64 MiB)",
    )
    archive.set_defaults(handler=run_archive)

    purge = subparsers.add_parser(
        "purge",
        help="remove archived entries from the stream (operator credential)",
        description="Remove the stream's entries up to --up-to, which must end a sealed segment "
        "of --archive (with its checkpoint), and which every reader can start past: each "
        "durable consumer of the stream (<service>-<instance>) needs a snapshot given "
        "(--snapshot FILE, --snapshot-dir DIR: its *.snapshot files) covering at least "
        "--up-to. Anything else is refused, saying why. Only the operator's credential "
        "(`gpupool credentials generate` writes operator.nk) may purge.",
    )
    _connection_arguments(purge)
    purge.add_argument("--archive", type=Path, required=True, metavar="DIR")
    purge.add_argument("--up-to", type=int, required=True, metavar="SEQ")
    purge.add_argument(
        "--snapshot",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="a service instance's snapshot, <service>-<instance>.snapshot (repeat)",
    )
    purge.add_argument(
        "--snapshot-dir",
        type=Path,
        action="append",
        default=[],
        metavar="DIR",
        help="every *.snapshot in DIR (a service's --snapshot-dir; repeat)",
    )
    purge.set_defaults(handler=run_purge)


def _connection_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nats",
        metavar="URL",
        help="the stream's NATS (default: $GPUPOOL_NATS_URL, else the running `gpupool up`)",
    )
    parser.add_argument("--stream", default=DEFAULT_STREAM)
    parser.add_argument("--subject-prefix", default=DEFAULT_SUBJECT_PREFIX)
    parser.add_argument(
        "--nats-credentials",
        type=Path,
        metavar="FILE",
        help="the operator's seed, operator.nk (default: $GPUPOOL_NATS_CREDENTIALS)",
    )
    parser.add_argument(
        "--nats-ca", type=Path, metavar="FILE", help="the NATS CA (default: $GPUPOOL_NATS_CA)"
    )


async def _connect(args: argparse.Namespace) -> StreamOperator:
    import os

    from gpupool.eventlog.archive import StreamOperator
    from gpupool.eventlog.credentials import OPERATOR
    from gpupool.eventlog.reader import StreamMissing

    url = args.nats
    if url is None:
        found = find_nats_url()
        if found is None:
            raise InvalidInput("no NATS to read: give --nats URL or set GPUPOOL_NATS_URL")
        url = found[0]
    env = os.environ.get
    credentials = args.nats_credentials or (
        Path(env("GPUPOOL_NATS_CREDENTIALS", "")) if env("GPUPOOL_NATS_CREDENTIALS") else None
    )
    ca = args.nats_ca or (Path(env("GPUPOOL_NATS_CA", "")) if env("GPUPOOL_NATS_CA") else None)
    try:
        operator = await StreamOperator.connect(
            url,
            stream=args.stream,
            subject_prefix=args.subject_prefix,
            credentials=credentials,
            tls_ca=ca,
            name="gpupool-operator",
            user=OPERATOR,
        )
    except (ConnectionError, OSError, TimeoutError, ValueError) as exc:
        raise CommandFailed(f"{url}: cannot connect: {exc}") from exc
    try:
        await operator.sequences()
    except StreamMissing as exc:
        await operator.close()
        raise CommandFailed(f"{url}: {exc}") from exc
    return operator


async def run_archive(args: argparse.Namespace) -> int:
    from gpupool.eventlog.archive import SEGMENT_ENTRIES, Archive, ArchiveError, archive_stream
    from gpupool.runtime.checkpoint import archive_checkpointer

    archive = Archive(args.to)
    operator = await _connect(args)
    try:
        run = await archive_stream(
            operator,
            archive,
            up_to=args.up_to,
            segment_entries=args.segment_entries or SEGMENT_ENTRIES,
            checkpointer=archive_checkpointer(archive),
        )
    except ArchiveError as exc:
        raise CommandFailed(f"archive {args.to}: {exc}") from exc
    finally:
        await operator.close()
    for name in run.removed:
        print(f"removed {name}: left unsealed by an interrupted run")
    for manifest in run.sealed:
        print(
            f"sealed {manifest.segment}: {manifest.count} entries, sha256 {manifest.sha256}, "
            f"checkpoint {manifest.checkpoint}"
        )
    if run.sealed:
        print(f"archive {args.to} ends at sequence {run.last_seq}")
    else:
        print(f"nothing new to archive: archive {args.to} ends at sequence {run.last_seq}")
    return EXIT_OK


def _snapshot_files(args: argparse.Namespace) -> list[Path]:
    files = list(args.snapshot)
    for directory in args.snapshot_dir:
        if not directory.is_dir():
            raise InvalidInput(f"{directory}: no such snapshot directory")
        files += sorted(directory.glob("*.snapshot"))
    return files


async def run_purge(args: argparse.Namespace) -> int:
    from gpupool.eventlog.archive import (
        Archive,
        ArchiveError,
        PurgeRefused,
        ReaderStart,
        archived_message,
        check_purge,
    )
    from gpupool.runtime.snapshot import SnapshotFormatError, decode_snapshot

    starts: list[ReaderStart] = []
    for path in _snapshot_files(args):
        try:
            snapshot = decode_snapshot(path.read_bytes())
        except (OSError, SnapshotFormatError) as exc:
            raise InvalidInput(f"{path}: not a readable snapshot: {exc}") from exc
        starts.append(ReaderStart(path.name.removesuffix(".snapshot"), snapshot.last_seq))
    archive = Archive(args.archive)
    try:
        sealed = archive.sealed()
    except ArchiveError as exc:
        raise CommandFailed(f"archive {args.archive}: {exc}") from exc
    if sealed and sealed[-1].manifest.stream != args.stream:
        raise CommandFailed(
            f"archive {args.archive} is of stream {sealed[-1].manifest.stream}, not {args.stream}"
        )
    operator = await _connect(args)
    try:
        first, last = await operator.sequences()
        durables = await operator.durables()
        try:
            removed = check_purge(
                args.up_to,
                archive_last=sealed[-1].manifest.last_seq if sealed else 0,
                checkpoints=[s.manifest.last_seq for s in sealed if s.manifest.checkpoint],
                stream_first=first,
                stream_last=last,
                durables=durables,
                snapshots=starts,
            )
        except PurgeRefused as exc:
            raise CommandFailed(f"refused to purge up to {args.up_to}: {exc}") from exc
        # the archive is of this stream: its entry at the cut is the stream's, byte for byte
        try:
            kept = archived_message(archive, sealed, args.up_to)
        except ArchiveError as exc:
            raise CommandFailed(f"archive {args.archive}: {exc}") from exc
        if await operator.message(args.up_to) != (kept.subject, kept.data):
            raise CommandFailed(
                f"refused to purge up to {args.up_to}: the stream's entry {args.up_to} differs "
                f"from the archive's: archive {args.archive} is not of this stream"
            )
        try:
            await operator.purge_through(args.up_to)
        except Exception as exc:  # the server's refusal (permissions, a timeout) says why
            raise CommandFailed(f"the server refused the purge: {exc}") from exc
        first, last = await operator.sequences()
    finally:
        await operator.close()
    print(
        f"purged {removed} entries up to sequence {args.up_to} of stream {args.stream}: it "
        f"starts at {first} now; read the whole log with --archive {args.archive}"
    )
    return EXIT_OK
