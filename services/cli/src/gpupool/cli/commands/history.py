"""``gpupool history POD``: one pod's whole timeline, one line per step (``-o`` json/yaml: the
read model ``gpupool.audit.History``)."""

from __future__ import annotations

import argparse
from datetime import datetime

from gpupool.audit import History, parse_pod, pod_history
from gpupool.audit.describe import step_text
from gpupool.cli.exits import EXIT_OK
from gpupool.cli.log_source import add_log_source_arguments
from gpupool.cli.main import Subparsers
from gpupool.cli.output import Printer, add_output_argument, audit_errors, run_read
from gpupool.cli.times import format_offset, format_time
from gpupool.eventlog.port import Entry

STYLES = {
    "assigned": "green",
    "bound": "green",
    "preempted": "red",
    "preempts": "magenta",
    "rejected": "red",
    "ready": "yellow",
    "moved": "yellow",
}


def register(subparsers: Subparsers) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "history",
        help="one pod's timeline: waits, positions, GPUs, preemptions, releases",
        description="Print every step of a pod: registered, each ready and its queue position, "
        "each change of position, the GPU it got, who preempted whom, releases, removal.",
    )
    parser.add_argument("pod", metavar="POD", help="NAMESPACE/NAME or NAME (namespace default)")
    add_log_source_arguments(parser)
    add_output_argument(parser)
    parser.set_defaults(handler=run)


def render(history: History, *, wide: bool = False) -> list[tuple[str, str | None]]:
    offsets = [format_offset(step.time, history.origin) for step in history.steps]
    seqs = [f"#{step.seq}" for step in history.steps]
    offset_width = max(len(text) for text in offsets)
    seq_width = max(len(text) for text in seqs)
    kind_width = max(len(step.kind) for step in history.steps)
    header = (
        f"history of {history.pod} on {history.node} "
        f"(offsets from the first entry, {format_time(history.origin)})"
    )
    lines: list[tuple[str, str | None]] = [(header, "bold")]
    for offset, seq, step in zip(offsets, seqs, history.steps, strict=True):
        kind = f"{step.kind.ljust(kind_width)}  " if wide else ""
        lines.append(
            (
                f"{offset.rjust(offset_width)}  {format_time(step.time)}  "
                f"{seq.ljust(seq_width)}  {kind}{step_text(step)}",
                STYLES.get(step.kind),
            )
        )
    return lines


def show(args: argparse.Namespace, printer: Printer, entries: list[Entry]) -> None:
    with audit_errors():
        history = pod_history(entries, parse_pod(args.pod))
    if args.output in ("json", "yaml"):
        printer.data(history, args.output)
    else:
        printer.lines(render(history, wide=args.output == "wide"))


async def run(args: argparse.Namespace) -> int:
    with audit_errors():
        parse_pod(args.pod)

    def shown(printer: Printer, entries: list[Entry], _now: datetime | None) -> None:
        show(args, printer, entries)

    await run_read(args, shown)
    return EXIT_OK
