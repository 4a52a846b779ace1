"""``gpupool state [--at TIME]``: queues, positions, waits and GPU occupancy, now or at a past
moment (``--watch``: live, waits measured against the clock)."""

from __future__ import annotations

import argparse
from datetime import datetime

from gpupool.audit import NodeView, StateView, log_origin, state_at
from gpupool.audit.describe import qos_text, share_text
from gpupool.cli.exits import EXIT_OK, InvalidInput
from gpupool.cli.log_source import add_log_source_arguments
from gpupool.cli.main import Subparsers
from gpupool.cli.output import (
    Printer,
    add_output_argument,
    add_watch_argument,
    clock,
    run_read,
    table,
)
from gpupool.cli.times import format_duration, format_offset, format_time, parse_moment
from gpupool.eventlog.port import Entry
from gpupool.events import event_tag

Line = tuple[str, str | None]


def register(subparsers: Subparsers) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "state",
        help="queues, positions and GPU occupancy now (or at a past moment with --at)",
        description="Fold the log up to TIME (default: now) and print each node's GPUs (which "
        "pods, their limits, the sum per GPU), its ready queue with positions, waits and "
        "estimates, and its dormant pods.",
    )
    parser.add_argument(
        "--at",
        metavar="TIME",
        help="RFC3339 (2025-01-01T00:01:05Z) or an offset from the first entry (+65s, +1m05s); "
        "default: now",
    )
    parser.add_argument("--node", metavar="NODE", help="only this node")
    add_log_source_arguments(parser)
    add_output_argument(parser)
    add_watch_argument(parser)
    parser.set_defaults(handler=run)


def render(view: StateView, *, wide: bool = False) -> list[Line]:
    origin = view.origin
    at = f"{format_offset(view.at, origin)} ({format_time(view.at)})"
    if view.last is None:
        lines: list[Line] = [
            (f"state at {at}: before the first entry, nothing is known yet", "bold")
        ]
    else:
        last = view.last
        lines = [
            (
                f"state at {at}: {view.entries} entries folded, the last #{last.seq} "
                f"{event_tag(last.envelope.event)} at {format_offset(last.envelope.time, origin)}",
                "bold",
            )
        ]
    for node in view.nodes:
        lines.extend(render_node(node, view.at, origin, wide=wide))
    return lines


def render_node(
    node: NodeView, at: datetime, origin: datetime, *, wide: bool = False
) -> list[Line]:
    source = f" ({node.inventory_source})" if node.inventory_source else ""
    if node.policy is None:
        head = f"node {node.name}: GPU sharing not enabled, {len(node.gpus)} GPUs{source}"
    else:
        head = (
            f"node {node.name}: {node.policy}, {len(node.gpus)} GPUs{source}, {qos_text(node.qos)}"
        )
    lines: list[Line] = [(head, "bold cyan")]
    if node.rejection is not None:
        lines.append(
            (f"  last configuration rejected: {node.rejection[0]}: {node.rejection[1]}", "red")
        )
    lines.append(
        (f"  requests: {share_text(node.requested)} of {node.allocatable}% allocatable each", None)
    )
    for gpu in node.gpus:
        uuid = f" {gpu.uuid}" if gpu.uuid else ""
        lines.append((f"  GPU {gpu.index}{uuid}: {share_text(gpu.used)} used by {gpu.basis}", None))
        if not gpu.pods:
            lines.append(("    idle", "dim"))
        for slot in gpu.pods:
            if slot.policy == "static":
                held = (
                    f"requests {share_text(slot.requests)}, limits {share_text(slot.limits)}, "
                    "bound (static)"
                )
            else:
                since = f", running since {format_offset(slot.since, origin)}" if slot.since else ""
                held = f"limits {share_text(slot.limits)}, priority {slot.priority}{since}"
                if wide:
                    held += f", requests {share_text(slot.requests)}"
            style = "green"
            if slot.evicted_by is not None:
                held += f", being preempted for {slot.evicted_by} ({slot.evict_reason})"
                style = "red"
            lines.append((f"    {slot.pod}  {held}", style))
    if not node.queue:
        lines.append(("  ready queue: empty", None))
    else:
        lines.append((f"  ready queue ({len(node.queue)}):", None))
        for queued in node.queue:
            waited = ""
            if queued.ready_since is not None:
                waited = (
                    f", waiting {format_duration(at - queued.ready_since)} "
                    f"(since {format_offset(queued.ready_since, origin)})"
                )
            if wide and queued.estimate is not None:
                wait = queued.estimate.wait
                waited += (
                    f", ETA {format_offset(at + wait, origin)} (about {format_duration(wait)} more)"
                    if wait is not None
                    else ", no ETA yet"
                )
            lines.append(
                (
                    f"    {queued.position}  {queued.pod}  priority {queued.priority}, "
                    f"limits {share_text(queued.limits)}{waited}",
                    "yellow",
                )
            )
    dormant = ", ".join(str(pod) for pod in node.dormant) or "none"
    lines.append((f"  dormant: {dormant}", None))
    return lines


def queue_table(view: StateView) -> list[str]:
    """The ready queues alone, one row per waiting pod (used by ``-o wide``)."""
    rows = []
    for node in view.nodes:
        for queued in node.queue:
            eta = "-"
            if queued.estimate is not None and queued.estimate.wait is not None:
                eta = format_offset(view.at + queued.estimate.wait, view.origin)
            rows.append(
                (
                    node.name,
                    str(queued.position),
                    str(queued.pod),
                    str(queued.priority),
                    format_duration(queued.waited) if queued.waited is not None else "-",
                    eta,
                )
            )
    if not rows:
        return []
    return table(("NODE", "POSITION", "POD", "PRIORITY", "WAITED", "ETA"), rows)


def show(
    args: argparse.Namespace, printer: Printer, entries: list[Entry], now: datetime | None
) -> None:
    origin = log_origin(entries)
    if origin is None:
        raise InvalidInput("the log has no readable entries")
    at = parse_moment(args.at, origin) if args.at else (now or clock())
    view = state_at(entries, at, args.node)
    if args.output in ("json", "yaml"):
        printer.data(view, args.output)
        return
    wide = args.output == "wide"
    printer.lines(render(view, wide=wide))
    if wide:
        printer.lines(queue_table(view))


async def run(args: argparse.Namespace) -> int:
    if args.watch and args.at:
        raise InvalidInput("--watch shows the state now; it cannot be combined with --at")

    def shown(printer: Printer, entries: list[Entry], now: datetime | None) -> None:
        show(args, printer, entries, now)

    await run_read(args, shown)
    return EXIT_OK
