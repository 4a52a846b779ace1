"""``gpupool run --pod NAME [--namespace NS] [--requeue] -- CMD...``: run CMD when the pod gets a GPU.

The argument parsing and the protocol live in gpupool.workload (the client side
of the node-executor's socket); this module only plugs it into the CLI.
"""

from __future__ import annotations

import argparse

from gpupool.workload.client import RUN_USAGE, run_main

RUN_HELP = f"""{RUN_USAGE}

Declare the pod ready, wait for a GPU (with its position in the node's queue
printed while it waits), then run CMD on the GPU the node-executor assigns.

options:
  --pod NAME               the pod (default $POD_NAME)
  --namespace NS           its namespace (default $POD_NAMESPACE, else default)
  --requeue                after a preemption, queue again instead of exiting
  --socket PATH            the node-executor's socket (default $GPUPOOL_SOCKET,
                           else /run/gpupool/gpupool.sock)
  --reconnect-seconds S    how long to keep trying when the executor restarts
  -h, --help               show this help and exit

The exit status is CMD's own, or one of gpupool run's (docs/troubleshooting.md)."""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "run",
        help="declare the pod ready, wait for a GPU, run CMD on it",
        usage=RUN_USAGE,
        description=RUN_HELP,
        add_help=False,
    )
    parser.add_argument("arguments", nargs=argparse.REMAINDER)
    parser.set_defaults(handler=lambda args: run_main(args.arguments))
