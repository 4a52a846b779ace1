"""``gpupool explain POD``: why a waiting pod waits, and an estimate of how much longer.

Every reason it prints is one :class:`gpupool.audit.Reason`, read off the core's
structured diagnosis (``gpupool.core.diagnosis``): the scheduler's and the
preemption planner's own rules decide what it says.
"""

from __future__ import annotations

import argparse
from datetime import datetime

from gpupool.audit import Explanation, Reason, WaitEstimate, explain, log_origin, parse_pod
from gpupool.audit.describe import share_text, step_text
from gpupool.cli.exits import EXIT_OK, InvalidInput
from gpupool.cli.log_source import add_log_source_arguments
from gpupool.cli.main import Subparsers
from gpupool.cli.output import (
    Printer,
    add_output_argument,
    add_watch_argument,
    audit_errors,
    run_read,
)
from gpupool.cli.times import format_duration, format_offset, format_time, parse_moment
from gpupool.eventlog.port import Entry

Line = tuple[str, str | None]

PROTECTED = {
    "static": "it is a static pod (never preempted)",
    "being-preempted": "it is already being preempted",
    "not-running": "it does not hold its GPU yet",
    "higher-priority": "its priority {priority} is above the head's {head_priority}",
    "same-priority-no-max-duration": (
        "its priority {priority} is not below the head's {head_priority}, and "
        "podMaxDurationMinutes is not set"
    ),
    "same-priority-held-too-briefly": (
        "its priority {priority} is not below the head's {head_priority}, and it has held its "
        "GPU for less than podMaxDurationMinutes ({minutes} min)"
    ),
}


def register(subparsers: Subparsers) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "explain",
        help="why a waiting pod waits: position, who is ahead, GPUs, blockers, an estimate",
        description="Explain why a pod waits: its position and who is ahead, which GPU it would "
        "need, what blocks it (the core's own diagnosis), and an estimate of its remaining "
        "wait from recent history.",
    )
    parser.add_argument("pod", metavar="POD", help="NAMESPACE/NAME or NAME (namespace default)")
    parser.add_argument(
        "--at",
        metavar="TIME",
        help="as of this time (default: the log's last entry; with --watch: now)",
    )
    add_log_source_arguments(parser)
    add_output_argument(parser)
    add_watch_argument(parser)
    parser.set_defaults(handler=run)


def reason_text(reason: Reason, origin: datetime) -> str:
    """One reason in words (``origin``: for offsets)."""
    match reason.kind:
        case "not-share-pool":
            return f"the node does not run share-pool (policy {reason.policy or 'none'})"
        case "no-gpus-known":
            return "the node's GPU inventory is not known yet"
        case "gpu-fits":
            assert reason.free is not None
            return f"GPU {reason.gpu_index}: it fits ({share_text(reason.free)} free)"
        case "gpu-too-full":
            assert reason.used is not None and reason.free is not None
            return (
                f"GPU {reason.gpu_index}: it does not fit: {' and '.join(reason.short)} short "
                f"(used {share_text(reason.used)}, free {share_text(reason.free)})"
            )
        case "reserved-for-head":
            return f"GPU {reason.gpu_index} is reserved for the head, {reason.pod}"
        case "assigned-next-pass":
            return f"nothing: it is assigned GPU {reason.gpu_index} at the next scheduling pass"
        case "queue-moving":
            moving = ", ".join(str(v) for v in reason.victims)
            return (
                f"the next scheduling pass assigns {moving} first; its own case is decided "
                "again after that"
            )
        case "head-of-line":
            return (
                f"head-of-line: the queue is served in order and the head is {reason.pod} "
                f"(priority {reason.priority})"
            )
        case "backfill-off":
            return f"it would fit GPU {reason.gpu_index} now, but backfill is off on this node"
        case "backfill-reserved-only":
            return (
                f"backfill is on, but the only GPU it fits, GPU {reason.gpu_index}, is reserved "
                "for the head"
            )
        case "backfill-no-room":
            assert reason.needs is not None
            return f"backfill is on, but no GPU has {share_text(reason.needs)} free for it"
        case "head-fits-nowhere":
            assert reason.needs is not None
            return f"the head, {reason.pod}, fits on no GPU: it needs {share_text(reason.needs)}"
        case "preemption-under-way":
            return (
                f"preemption under way: {reason.pod} on GPU {reason.gpu_index} is being "
                f"preempted for {reason.preemptor}"
            )
        case "preemption-disabled":
            return "preemption is disabled on this node (preemptEnabled is false)"
        case "victim-eligible":
            because = (
                f"priority {reason.priority} below the head's {reason.head_priority}"
                if reason.why == "priority"
                else "it has held its GPU for podMaxDurationMinutes"
            )
            return f"{reason.pod} on GPU {reason.gpu_index} may be preempted ({because})"
        case "victim-protected":
            why = PROTECTED[reason.why].format(
                priority=reason.priority, head_priority=reason.head_priority, minutes=reason.minutes
            )
            return f"{reason.pod} on GPU {reason.gpu_index} may not be preempted: {why}"
        case "victims-free-too-little":
            assert reason.free is not None and reason.needs is not None
            victims = ", ".join(str(v) for v in reason.victims)
            return (
                f"GPU {reason.gpu_index}: preempting {victims} would leave "
                f"{share_text(reason.free)} used, too much for {share_text(reason.needs)}"
            )
        case "preemption-due":
            victims = ", ".join(str(v) for v in reason.victims)
            return (
                f"a preemption is due: {victims} on GPU {reason.gpu_index} for "
                f"{reason.preemptor}; the preemption service plans it at its next pass"
            )
        case "next-check":
            assert reason.at is not None
            who = ", ".join(str(v) for v in reason.victims) or "a running pod"
            return (
                f"{who} reaches podMaxDurationMinutes ({reason.minutes} min) at "
                f"{format_offset(reason.at, origin)}; preemption is considered again then"
            )
    raise AssertionError(reason.kind)


def estimate_text(estimate: WaitEstimate | None) -> str:
    if estimate is None or estimate.wait is None or estimate.median_hold is None:
        node = estimate.node if estimate is not None else "the node"
        return f"no estimate: no assignment on {node} has completed yet"
    plural = "s" if estimate.sample > 1 else ""
    return (
        f"about {format_duration(estimate.wait)} more = median hold "
        f"{format_duration(estimate.median_hold)} (the {estimate.sample} most recent completed "
        f"assignment{plural} on {estimate.node}) × {estimate.position} (pods ahead "
        f"{estimate.position - 1} + itself) / {estimate.gpus} GPUs; an estimate from recent "
        "history, not a promise"
    )


def status_text(explanation: Explanation) -> str:
    e = explanation
    origin = e.origin
    match e.phase:
        case "unregistered":
            said = step_text(e.last_step) if e.last_step is not None else "not registered yet"
            return f"{e.pod} is not registered at this time (its last step: {said})"
        case "running":
            since = f" since {format_offset(e.running_since, origin)}" if e.running_since else ""
            evicting = (
                f"; it is being preempted for {e.evicted_by} ({e.evict_reason})"
                if e.evicted_by is not None
                else ""
            )
            return (
                f"{e.pod} is not waiting: it runs on GPU {e.gpu_index} of {e.node}{since}{evicting}"
            )
        case "dormant":
            return f"{e.pod} is not waiting: it is dormant on {e.node} (it has not asked for a GPU)"
    ready_since = e.ready_since or e.at
    return (
        f"{e.pod} waits on {e.node}: position {e.position} of {e.queue_length}, ready since "
        f"{format_offset(ready_since, origin)} ({format_duration(e.at - ready_since)} so far)"
    )


def render(explanation: Explanation, *, wide: bool = False) -> list[Line]:
    origin = explanation.origin
    lines: list[Line] = [
        (status_text(explanation), "bold"),
        (f"as of {format_offset(explanation.at, origin)} ({format_time(explanation.at)})", None),
    ]
    if explanation.phase != "waiting":
        return lines
    if explanation.ahead:
        lines.append(("ahead of it:", None))
        for queued in explanation.ahead:
            since = (
                f", ready since {format_offset(queued.ready_since, origin)}"
                if queued.ready_since is not None
                else ""
            )
            lines.append(
                (
                    f"  {queued.position}  {queued.pod}  priority {queued.priority}, "
                    f"limits {share_text(queued.limits)}{since}",
                    None,
                )
            )
    else:
        lines.append(("ahead of it: nobody (it is the head of the queue)", None))
    assert explanation.needs is not None
    lines.append((f"it needs {share_text(explanation.needs)} free on one GPU (its limits)", None))
    lines.append((f"what decides (verdict {explanation.verdict}):", None))
    for reason in explanation.reasons:
        kind = f" [{reason.kind}]" if wide else ""
        style = "green" if reason.kind in ("gpu-fits", "victim-eligible") else None
        lines.append((f"  - {reason_text(reason, origin)}{kind}", style))
    lines.append((f"estimate: {estimate_text(explanation.estimate)}", None))
    return lines


def show(
    args: argparse.Namespace, printer: Printer, entries: list[Entry], now: datetime | None
) -> None:
    at = parse_moment(args.at, log_origin(entries)) if args.at else now
    explanation = explain(entries, parse_pod(args.pod), at)
    if args.output in ("json", "yaml"):
        printer.data(explanation, args.output)
    else:
        printer.lines(render(explanation, wide=args.output == "wide"))


async def run(args: argparse.Namespace) -> int:
    if args.watch and args.at:
        raise InvalidInput("--watch explains the pod now; it cannot be combined with --at")
    with audit_errors():
        parse_pod(args.pod)

    def shown(printer: Printer, entries: list[Entry], now: datetime | None) -> None:
        show(args, printer, entries, now)

    await run_read(args, shown)
    return EXIT_OK
