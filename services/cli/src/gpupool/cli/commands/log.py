"""``gpupool log``: the entries of the log, filtered: a table (``-o table|wide``), one JSON or
YAML document (``-o json|yaml``), or JSON lines (``--json``, and ``-o json --follow``)."""

from __future__ import annotations

import argparse
import sys
from datetime import datetime

import msgspec

from gpupool.audit import UNDECODABLE_TYPE, LogFilter, entry_matches, log_origin, parse_pod
from gpupool.audit.describe import event_details, event_pod_column
from gpupool.cli.commands.log_archive import register_actions
from gpupool.cli.exits import EXIT_OK
from gpupool.cli.log_source import (
    add_log_source_arguments,
    open_log_source,
    progress_for,
    read_entries,
)
from gpupool.cli.main import Subparsers
from gpupool.cli.output import Printer, add_output_argument, audit_errors, encode, table
from gpupool.cli.times import format_offset, format_time, parse_moment
from gpupool.eventlog.port import Entry, StoredEvent
from gpupool.events import Envelope, encode_envelope, event_tag

COLUMNS = ("SEQ", "TIME", "OFFSET", "TYPE", "NODE", "POD", "DETAILS")
WIDE_COLUMNS = ("SEQ", "TIME", "OFFSET", "TYPE", "NODE", "POD", "ID", "SUBJECT", "DETAILS")
STYLES = {"Preempted": "red", "Assigned": "green", "PodReady": "yellow", UNDECODABLE_TYPE: "red"}


class LoggedEntry(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """An entry as ``-o json|yaml`` prints it: its sequence, subject, and envelope or error."""

    seq: int
    subject: str
    envelope: Envelope | None = None
    error: str | None = None


def register(subparsers: Subparsers) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "log",
        help="print the event log, filtered",
        description="Print the entries of the event log as a table (or JSON/YAML), filtered by "
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
    parser.add_argument("--json", action="store_true", help="one JSON envelope per line, as logged")
    add_output_argument(parser)
    parser.add_argument("--follow", "-f", action="store_true", help="keep printing new entries")
    parser.set_defaults(handler=run)
    actions = parser.add_subparsers(
        dest="action",
        metavar="ACTION",
        required=False,
        title="retention (docs/eventlog.md)",
    )
    register_actions(actions)


def row(entry: Entry, origin: datetime | None, *, wide: bool = False) -> tuple[str, ...]:
    if isinstance(entry, StoredEvent):
        envelope = entry.envelope
        event = envelope.event
        offset = format_offset(envelope.time, origin) if origin is not None else ""
        cells = [
            str(entry.seq),
            format_time(envelope.time),
            offset,
            event_tag(event),
            event.node or "-",
            event_pod_column(event) or "-",
        ]
        if wide:
            cells += [envelope.id, entry.subject or "-"]
        return (*cells, event_details(event))
    where = f"{entry.subject}: " if entry.subject else ""
    cells = [str(entry.seq), "-", "-", UNDECODABLE_TYPE, "-", "-"]
    if wide:
        cells += ["-", entry.subject or "-"]
    return (*cells, f"{where}{entry.error}")


def logged(entry: Entry) -> LoggedEntry:
    if isinstance(entry, StoredEvent):
        return LoggedEntry(seq=entry.seq, subject=entry.subject, envelope=entry.envelope)
    return LoggedEntry(seq=entry.seq, subject=entry.subject, error=entry.error)


def write_entry_json(entry: Entry) -> None:
    if isinstance(entry, StoredEvent):
        sys.stdout.write(encode_envelope(entry.envelope).decode() + "\n")
    else:
        print(f"gpupool log: entry {entry.seq} is unreadable: {entry.error}", file=sys.stderr)


def print_rows(printer: Printer, lines: list[str], rows: list[tuple[str, ...]]) -> None:
    for line, cells in zip(lines, rows, strict=True):
        printer.line(line, STYLES.get(cells[3]))


async def run(args: argparse.Namespace) -> int:
    printer = Printer()
    wide = args.output == "wide"
    widths: list[int] = []
    source = await open_log_source(args)
    try:
        entries = await read_entries(source, progress=progress_for(args))
        origin = log_origin(entries)
        with audit_errors():
            pod = parse_pod(args.pod) if args.pod else None
        selection = LogFilter(
            pod=pod,
            node=args.node,
            types=frozenset(args.types),
            since=parse_moment(args.since, origin) if args.since else None,
            until=parse_moment(args.until, origin) if args.until else None,
        )
        chosen = [entry for entry in entries if entry_matches(entry, selection)]
        lines_mode = args.json or (args.output == "json" and args.follow)
        if lines_mode:
            for entry in chosen:
                if args.json:
                    write_entry_json(entry)
                else:
                    sys.stdout.write(msgspec.json.encode(logged(entry)).decode() + "\n")
        elif args.output in ("json", "yaml"):
            sys.stdout.write(encode([logged(entry) for entry in chosen], args.output))
        else:
            rows = [row(entry, origin, wide=wide) for entry in chosen]
            columns = WIDE_COLUMNS if wide else COLUMNS
            widths = [
                max(len(cells[i]) for cells in [columns, *rows]) for i in range(len(columns) - 1)
            ]
            lines = table(columns, rows)
            printer.line(lines[0], "bold")
            print_rows(printer, lines[1:], rows)
        sys.stdout.flush()
        if args.follow:
            last = entries[-1].seq if entries else 0
            async for entry in source.follow(last):
                origin = origin or log_origin([entry])
                if not entry_matches(entry, selection):
                    continue
                if args.json:
                    write_entry_json(entry)
                elif args.output == "json":
                    sys.stdout.write(msgspec.json.encode(logged(entry)).decode() + "\n")
                elif args.output == "yaml":
                    sys.stdout.write("---\n" + encode(logged(entry), "yaml"))
                else:
                    cells = row(entry, origin, wide=wide)
                    padded = [c.ljust(w) for c, w in zip(cells, widths, strict=False)]
                    printer.line("  ".join([*padded, cells[-1]]), STYLES.get(cells[3]))
                sys.stdout.flush()
    finally:
        await source.close()
    return EXIT_OK
