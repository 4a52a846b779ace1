"""``gpupool explain POD``: why a waiting pod waits, and an estimate of how much longer."""

from __future__ import annotations

import argparse

from gpupool.cli.audit import Explanation, explain, log_origin, parse_pod, share_text
from gpupool.cli.exits import EXIT_OK
from gpupool.cli.log_source import add_log_source_arguments, read_log
from gpupool.cli.main import Subparsers
from gpupool.cli.times import format_offset, format_time, parse_moment


def register(subparsers: Subparsers) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "explain",
        help="why a waiting pod waits: position, who is ahead, GPUs, blockers, an estimate",
        description="Explain why a pod waits: its position and who is ahead, which GPU it would "
        "need, what blocks it, and an estimate of its remaining wait from recent history.",
    )
    parser.add_argument("pod", metavar="POD", help="NAMESPACE/NAME or NAME (namespace default)")
    parser.add_argument(
        "--at", metavar="TIME", help="as of this time (default: the log's last entry)"
    )
    add_log_source_arguments(parser)
    parser.set_defaults(handler=run)


def render(explanation: Explanation) -> list[str]:
    origin = explanation.origin
    lines = [
        explanation.status,
        f"as of {format_offset(explanation.at, origin)} ({format_time(explanation.at)})",
    ]
    if not explanation.waiting:
        return lines
    if explanation.ahead:
        lines.append("ahead of it:")
        for queued in explanation.ahead:
            since = (
                f", ready since {format_offset(queued.ready_since, origin)}"
                if queued.ready_since is not None
                else ""
            )
            lines.append(
                f"  {queued.position}  {queued.pod}  priority {queued.priority}, "
                f"limits {share_text(queued.limits)}{since}"
            )
    else:
        lines.append("ahead of it: nobody (it is the head of the queue)")
    assert explanation.needs is not None
    lines.append(f"it needs {share_text(explanation.needs)} free on one GPU (its limits):")
    for gpu in explanation.gpus:
        verdict = "fits" if gpu.fits else "does not fit"
        note = f" ({gpu.note})" if gpu.note else ""
        lines.append(
            f"  GPU {gpu.index}: used {share_text(gpu.used)}, free {share_text(gpu.free)}: "
            f"{verdict}{note}"
        )
    lines.append("what blocks it:")
    lines.extend(f"  - {blocker}" for blocker in explanation.blockers)
    lines.append(f"estimate: {explanation.estimate}")
    return lines


async def run(args: argparse.Namespace) -> int:
    pod = parse_pod(args.pod)
    entries = await read_log(args)
    at = parse_moment(args.at, log_origin(entries)) if args.at else None
    print("\n".join(render(explain(entries, pod, at))))
    return EXIT_OK
