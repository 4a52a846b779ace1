"""The ``gpupool`` command: each subcommand lives in its own module exposing ``register``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from types import ModuleType

from gpupool.cli import demo, run_command, up_command
from gpupool.workload.client import run_main

COMMAND_MODULES: tuple[ModuleType, ...] = (run_command, up_command, demo)
"""Adding a subcommand: write a module with ``register(subparsers)``, add it here."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpupool",
        description="GPU sharing for Kubernetes GPU nodes: share-pool queues, preemption, audit.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module in COMMAND_MODULES:
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["run"]:
        # `gpupool run` takes its own options and then `-- CMD...`: argparse would eat them
        return run_main(args_list[1:])
    args = build_parser().parse_args(args_list)
    code: int = args.handler(args)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
