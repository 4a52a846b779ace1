"""``gpupool history POD``: one pod's whole timeline, one line per step (``-o`` json/yaml: the
read model ``gpupool.audit.History``)."""

from __future__ import annotations

import argparse
from datetime import datetime, timedelta

from gpupool.audit import History, PodStep, QueueCause, parse_pod, pod_history
from gpupool.audit.describe import share_text
from gpupool.cli.exits import EXIT_OK
from gpupool.cli.log_source import add_log_source_arguments
from gpupool.cli.main import Subparsers
from gpupool.cli.output import Printer, add_output_argument, audit_errors, run_read
from gpupool.cli.times import format_duration, format_offset, format_time
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


def _cause_text(cause: QueueCause) -> str:
    match cause.what:
        case "assigned":
            return f"{cause.pod} left the queue (assigned GPU {cause.gpu_index})"
        case "joined":
            return f"{cause.pod} joined the queue"
        case "left":
            return f"{cause.pod} left the queue ({cause.reason})"
        case "removed":
            return f"{cause.pod} was removed"
    return f"{cause.what} {cause.pod or ''}".rstrip()


def _after(verb: str, duration: timedelta | None) -> str:
    return f" after {verb} {format_duration(duration)}" if duration is not None else ""


def step_text(step: PodStep) -> str:
    """One step in words."""
    match step.kind:
        case "registered":
            assert step.requests is not None and step.limits is not None
            return (
                f"registered on {step.node}: {step.policy}, requests "
                f"{share_text(step.requests)}, limits {share_text(step.limits)}, "
                f"priority {step.priority}"
            )
        case "rejected":
            return f"rejected, {step.reason}: {step.message}"
        case "ready":
            return f"ready: joins the queue at position {step.position} of {step.queue_length}"
        case "moved":
            assert step.cause is not None
            return (
                f"position {step.position} of {step.queue_length} (was {step.was}): "
                f"{_cause_text(step.cause)}"
            )
        case "bound":
            return f"bound to GPU {step.gpu_index} ({step.gpu_uuid}) at admission (static)"
        case "assigned":
            where = ", ".join(str(p) for p in step.positions)
            plural = "s" if len(step.positions) > 1 else ""
            return (
                f"assigned GPU {step.gpu_index} ({step.gpu_uuid}) after waiting "
                f"{format_duration(step.waited) if step.waited is not None else '?'} "
                f"at position{plural} {where}"
            )
        case "preempted":
            return (
                f"preempted by {step.other} on GPU {step.gpu_index} "
                f"(reason {step.reason}){_after('holding it', step.held)}"
            )
        case "preempts":
            return f"preempts {step.other} on GPU {step.gpu_index} (reason {step.reason})"
        case "left-queue":
            return f"left the queue: {step.reason}{_after('waiting', step.waited)}"
        case "released":
            exit_code = "" if step.exit_code is None else f" (exit code {step.exit_code})"
            return (
                f"released GPU {step.gpu_index}: {step.reason}{exit_code}"
                f"{_after('holding it', step.held)}"
            )
        case "removed":
            was = (
                f" (it was {step.phase_before})"
                if step.phase_before and step.phase_before != "dormant"
                else ""
            )
            return f"removed: the pod was deleted{was}"


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
