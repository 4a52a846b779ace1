"""The ``gpupool`` command: each subcommand lives in its own module exposing ``register``.

``register(subparsers)`` adds the module's subparser and sets ``handler``: a
function of the parsed arguments that returns an exit code, or a coroutine that
does (coroutines run with ``asyncio.run``). Adding a subcommand is one line in
:data:`COMMAND_MODULES`. Exit codes: 0 ok, 1 failure, 2 usage or invalid input
(see ``gpupool.cli.exits``).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import os
import sys
from collections.abc import Sequence
from typing import Protocol, TypeAlias

from gpupool.cli.exits import EXIT_OK, CommandFailed
from gpupool.workload.client import run_main

COMMAND_MODULES: tuple[str, ...] = (
    "gpupool.cli.commands.simulate",
    "gpupool.cli.commands.log",
    "gpupool.cli.commands.history",
    "gpupool.cli.commands.state",
    "gpupool.cli.commands.verify",
    "gpupool.cli.commands.explain",
    "gpupool.cli.commands.console",
    "gpupool.cli.run_command",
    "gpupool.cli.up_command",
    "gpupool.cli.demo",
)
"""Adding a subcommand: write a module with ``register(subparsers)``, add its name here."""

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


class CommandModule(Protocol):
    def register(self, subparsers: Subparsers) -> None: ...


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpupool",
        description="GPU sharing for Kubernetes GPU nodes: share-pool queues, preemption, audit.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        module: CommandModule = importlib.import_module(name)
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["run"]:
        # `gpupool run` takes its own options and then `-- CMD...`: argparse would eat them
        return run_main(args_list[1:])
    args = build_parser().parse_args(args_list)
    try:
        result = args.handler(args)
        if inspect.iscoroutine(result):
            result = asyncio.run(result)
    except CommandFailed as exc:
        print(f"gpupool {args.command}: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (``gpupool log | head``): not an error of ours. Point stdout
        # at /dev/null so that the interpreter's final flush does not complain.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    assert isinstance(result, int)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
