"""``gpupool log``: the entries of the log, filtered, as a table or as JSON lines."""

from __future__ import annotations

import argparse
import sys
from datetime import datetime

from gpupool.cli.audit import (
    UNDECODABLE_TYPE,
    LogFilter,
    entry_matches,
    event_details,
    event_pod_column,
    log_origin,
    parse_pod,
)
from gpupool.cli.exits import EXIT_OK
from gpupool.cli.log_source import (
    add_log_source_arguments,
    open_log_source,
    progress_for,
    read_entries,
)
from gpupool.cli.main import Subparsers
from gpupool.cli.times import format_offset, format_time, parse_moment
from gpupool.eventlog.port import Entry, StoredEvent
from gpupool.events import encode_envelope, event_tag

COLUMNS = ("SEQ", "TIME", "OFFSET", "TYPE", "NODE", "POD", "DETAILS")


def register(subparsers: Subparsers) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "log",
        help="print the event log, filtered",
        description="Print the entries of the event log as a table (or JSON lines), filtered by "
        "pod, node, type and time. Times: RFC3339 or an offset from the first entry (+65s).",
    )
    add_log_source_arguments(parser)
    parser.add_argument("--pod", metavar="NS/NAME", help="entries about this pod (incl. Preempted)")
    parser.add_argument("--node", metavar="NODE", help="entries of this node")
    parser.add_argument(
        "--type",
        dest="types",
        nargs="+",
        action="extend",
        default=[],
        metavar="TAG",
        help=f"event types, e.g. Assigned Preempted ({UNDECODABLE_TYPE}: unreadable entries)",
    )
    parser.add_argument("--since", metavar="TIME", help="entries at or after this time")
    parser.add_argument("--until", metavar="TIME", help="entries at or before this time")
    parser.add_argument("--json", action="store_true", help="one JSON envelope per line")
    parser.add_argument("--follow", "-f", action="store_true", help="keep printing new entries")
    parser.set_defaults(handler=run)


def row(entry: Entry, origin: datetime | None) -> tuple[str, ...]:
    if isinstance(entry, StoredEvent):
        envelope = entry.envelope
        event = envelope.event
        offset = format_offset(envelope.time, origin) if origin is not None else ""
        return (
            str(entry.seq),
            format_time(envelope.time),
            offset,
            event_tag(event),
            event.node or "-",
            event_pod_column(event) or "-",
            event_details(event),
        )
    where = f"{entry.subject}: " if entry.subject else ""
    return (str(entry.seq), "-", "-", UNDECODABLE_TYPE, "-", "-", f"{where}{entry.error}")


def format_rows(rows: list[tuple[str, ...]], widths: list[int]) -> list[str]:
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(r, widths, strict=True)).rstrip()
        for r in rows
    ]


def column_widths(rows: list[tuple[str, ...]]) -> list[int]:
    widths = [len(title) for title in COLUMNS]
    for r in rows:
        for index, cell in enumerate(r[:-1]):
            widths[index] = max(widths[index], len(cell))
    return widths


def write_entry_json(entry: Entry) -> None:
    if isinstance(entry, StoredEvent):
        sys.stdout.write(encode_envelope(entry.envelope).decode() + "\n")
    else:
        print(f"gpupool log: entry {entry.seq} is unreadable: {entry.error}", file=sys.stderr)


async def run(args: argparse.Namespace) -> int:
    source = await open_log_source(args)
    try:
        entries = await read_entries(source, progress=progress_for(args))
        origin = log_origin(entries)
        selection = LogFilter(
            pod=parse_pod(args.pod) if args.pod else None,
            node=args.node,
            types=frozenset(args.types),
            since=parse_moment(args.since, origin) if args.since else None,
            until=parse_moment(args.until, origin) if args.until else None,
        )
        chosen = [entry for entry in entries if entry_matches(entry, selection)]
        widths = column_widths([row(entry, origin) for entry in chosen])
        if args.json:
            for entry in chosen:
                write_entry_json(entry)
        else:
            rows = [COLUMNS, *(row(entry, origin) for entry in chosen)]
            print("\n".join(format_rows(rows, widths)))
        sys.stdout.flush()
        if args.follow:
            last = entries[-1].seq if entries else 0
            async for entry in source.follow(last):
                origin = origin or log_origin([entry])
                if not entry_matches(entry, selection):
                    continue
                if args.json:
                    write_entry_json(entry)
                else:
                    print(format_rows([row(entry, origin)], widths)[0])
                sys.stdout.flush()
    finally:
        await source.close()
    return EXIT_OK
