"""``gpupool state --at TIME``: queues, positions and GPU occupancy at a past moment."""

from __future__ import annotations

import argparse
from datetime import datetime

from gpupool.cli.audit import NodeView, StateView, log_origin, qos_text, share_text, state_at
from gpupool.cli.exits import EXIT_OK, InvalidInput
from gpupool.cli.log_source import add_log_source_arguments, read_log
from gpupool.cli.main import Subparsers
from gpupool.cli.times import format_duration, format_offset, format_time, parse_moment
from gpupool.events import event_tag


def register(subparsers: Subparsers) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "state",
        help="queues, positions and GPU occupancy at a past moment",
        description="Fold the log up to TIME and print each node's GPUs (which pods, their "
        "limits, the sum per GPU), its ready queue with positions, and its dormant pods.",
    )
    parser.add_argument(
        "--at",
        required=True,
        metavar="TIME",
        help="RFC3339 (2025-01-01T00:01:05Z) or an offset from the first entry (+65s, +1m05s)",
    )
    parser.add_argument("--node", metavar="NODE", help="only this node")
    add_log_source_arguments(parser)
    parser.set_defaults(handler=run)


def render(view: StateView) -> list[str]:
    origin = view.origin
    at = f"{format_offset(view.at, origin)} ({format_time(view.at)})"
    if view.last is None:
        lines = [f"state at {at}: before the first entry, nothing is known yet"]
    else:
        last = view.last
        lines = [
            f"state at {at}: {view.entries} entries folded, the last #{last.seq} "
            f"{event_tag(last.envelope.event)} at {format_offset(last.envelope.time, origin)}"
        ]
    for node in view.nodes:
        lines.extend(render_node(node, view.at, origin))
    return lines


def render_node(node: NodeView, at: datetime, origin: datetime) -> list[str]:
    source = f" ({node.inventory_source})" if node.inventory_source else ""
    if node.policy is None:
        lines = [f"node {node.name}: GPU sharing not enabled, {len(node.gpus)} GPUs{source}"]
    else:
        lines = [
            f"node {node.name}: {node.policy}, {len(node.gpus)} GPUs{source}, {qos_text(node.qos)}"
        ]
    if node.rejection is not None:
        lines.append(f"  last configuration rejected: {node.rejection[0]}: {node.rejection[1]}")
    lines.append(
        f"  requests: {share_text(node.requested)} of {node.allocatable}% allocatable each"
    )
    for gpu in node.gpus:
        uuid = f" {gpu.uuid}" if gpu.uuid else ""
        lines.append(f"  GPU {gpu.index}{uuid}: {share_text(gpu.used)} used by {gpu.basis}")
        if not gpu.pods:
            lines.append("    idle")
        for slot in gpu.pods:
            if slot.policy == "static":
                held = (
                    f"requests {share_text(slot.requests)}, limits {share_text(slot.limits)}, "
                    "bound (static)"
                )
            else:
                since = f", running since {format_offset(slot.since, origin)}" if slot.since else ""
                held = f"limits {share_text(slot.limits)}, priority {slot.priority}{since}"
            if slot.evicted_by is not None:
                held += f", being preempted for {slot.evicted_by} ({slot.evict_reason})"
            lines.append(f"    {slot.pod}  {held}")
    if not node.queue:
        lines.append("  ready queue: empty")
    else:
        lines.append(f"  ready queue ({len(node.queue)}):")
        for queued in node.queue:
            waited = ""
            if queued.ready_since is not None:
                waited = (
                    f", waiting {format_duration(at - queued.ready_since)} "
                    f"(since {format_offset(queued.ready_since, origin)})"
                )
            lines.append(
                f"    {queued.position}  {queued.pod}  priority {queued.priority}, "
                f"limits {share_text(queued.limits)}{waited}"
            )
    dormant = ", ".join(str(pod) for pod in node.dormant) or "none"
    lines.append(f"  dormant: {dormant}")
    return lines


async def run(args: argparse.Namespace) -> int:
    entries = await read_log(args)
    origin = log_origin(entries)
    if origin is None:
        raise InvalidInput("the log has no readable entries")
    view = state_at(entries, parse_moment(args.at, origin), args.node)
    print("\n".join(render(view)))
    return EXIT_OK
