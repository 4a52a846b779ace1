"""``gpupool console``: serve the read-only web console (on 127.0.0.1:8080 by default)."""

from __future__ import annotations

import argparse

from gpupool.cli.main import Subparsers
from gpupool.console.__main__ import add_arguments, serve


def register(subparsers: Subparsers) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "console",
        help="serve the web console: cluster, nodes, pods, GPU timeline, live from the log",
        description="Serve the read-only web console on this machine (127.0.0.1 by default): "
        "the cluster, each node's GPUs and ready queue (live), each pod's timeline, and a "
        "Gantt chart of who held each GPU when. It reads the log, never writes it.",
    )
    add_arguments(parser)
    parser.set_defaults(handler=run)


async def run(args: argparse.Namespace) -> int:
    await serve(args)
    return 0
