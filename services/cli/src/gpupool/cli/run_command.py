"""``gpupool run --pod NAME [--namespace NS] [--requeue] -- CMD...``: run CMD when the pod gets a GPU.

The argument parsing and the protocol live in gpupool.workload (the client side
of the node-executor's socket); this module only plugs it into the CLI.
"""

from __future__ import annotations

import argparse

from gpupool.workload.client import RUN_USAGE, run_main


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "run",
        help="declare the pod ready, wait for a GPU, run CMD on it",
        usage=RUN_USAGE,
        add_help=False,
    )
    parser.add_argument("arguments", nargs=argparse.REMAINDER)
    parser.set_defaults(handler=lambda args: run_main(args.arguments))
