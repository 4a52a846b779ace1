"""``gpupool history POD``: one pod's whole timeline, one line per step."""

from __future__ import annotations

import argparse

from gpupool.cli.audit import History, parse_pod, pod_history
from gpupool.cli.exits import EXIT_OK
from gpupool.cli.log_source import add_log_source_arguments, read_log
from gpupool.cli.main import Subparsers
from gpupool.cli.times import format_offset, format_time


def register(subparsers: Subparsers) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "history",
        help="one pod's timeline: waits, positions, GPUs, preemptions, releases",
        description="Print every step of a pod: registered, each ready and its queue position, "
        "each change of position, the GPU it got, who preempted whom, releases, removal.",
    )
    parser.add_argument("pod", metavar="POD", help="NAMESPACE/NAME or NAME (namespace default)")
    add_log_source_arguments(parser)
    parser.set_defaults(handler=run)


def render(history: History) -> list[str]:
    offsets = [format_offset(line.time, history.origin) for line in history.lines]
    seqs = [f"#{line.seq}" for line in history.lines]
    offset_width = max(len(text) for text in offsets)
    seq_width = max(len(text) for text in seqs)
    header = (
        f"history of {history.pod} on {history.node} "
        f"(offsets from the first entry, {format_time(history.origin)})"
    )
    return [
        header,
        *(
            f"{offset.rjust(offset_width)}  {format_time(line.time)}  "
            f"{seq.ljust(seq_width)}  {line.text}"
            for offset, seq, line in zip(offsets, seqs, history.lines, strict=True)
        ),
    ]


async def run(args: argparse.Namespace) -> int:
    pod = parse_pod(args.pod)
    entries = await read_log(args)
    print("\n".join(render(pod_history(entries, pod))))
    return EXIT_OK
