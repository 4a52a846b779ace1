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
from importlib.metadata import PackageNotFoundError, version
from typing import Protocol, TypeAlias

from gpupool.cli.exits import EXIT_OK, CommandFailed
from gpupool.cli.run_command import RUN_HELP
from gpupool.workload.client import run_main

COMMAND_MODULES: tuple[str, ...] = (
    "gpupool.cli.commands.simulate",
    "gpupool.cli.commands.log",
    "gpupool.cli.commands.history",
    "gpupool.cli.commands.state",
    "gpupool.cli.commands.verify",
    "gpupool.cli.commands.explain",
    "gpupool.cli.commands.console",
    "gpupool.cli.commands.credentials",
    "gpupool.cli.run_command",
    "gpupool.cli.up_command",
    "gpupool.cli.pod_command",
    "gpupool.cli.demo",
)
"""Adding a subcommand: write a module with ``register(subparsers)``, add its name here."""

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


class CommandModule(Protocol):
    def register(self, subparsers: Subparsers) -> None: ...


def gpupool_version() -> str:
    try:
        return version("gpupool-cli")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpupool",
        description="GPU sharing for Kubernetes GPU nodes: share-pool queues, preemption, audit.",
        epilog="`gpupool COMMAND --help` describes each command. Docs: docs/concepts.md.",
    )
    parser.add_argument("--version", action="version", version=f"gpupool {gpupool_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        module: CommandModule = importlib.import_module(name)
        module.register(subparsers)
    return parser


def subcommand_parser(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> argparse.ArgumentParser:
    """The innermost parser of the command line: its usage is the one to show on an error."""
    current = parser
    for dest in ("command", "action"):
        subparsers = [
            action
            for action in current._actions
            if isinstance(action, argparse._SubParsersAction) and action.dest == dest
        ]
        chosen = getattr(args, dest, None)
        if not subparsers or chosen is None or chosen not in subparsers[0].choices:
            break
        current = subparsers[0].choices[chosen]
    return current


def parse(parser: argparse.ArgumentParser, words: list[str]) -> argparse.Namespace:
    """Like ``parse_args``, but an unknown option is reported with its subcommand's usage."""
    args, extras = parser.parse_known_args(words)
    if extras:
        subcommand_parser(parser, args).error(f"unrecognized arguments: {' '.join(extras)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["run"]:
        # `gpupool run` takes its own options and then `-- CMD...`: argparse would eat them
        options = args_list[1 : args_list.index("--")] if "--" in args_list else args_list[1:]
        if "-h" in options or "--help" in options:
            print(RUN_HELP)
            return EXIT_OK
        return run_main(args_list[1:])
    args = parse(build_parser(), args_list)
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
