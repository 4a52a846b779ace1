"""``gpupool simulate SCENARIO.yaml [--output FILE]``: run a scenario through the core.

Prints the resulting event log as JSON lines (one envelope per line), identical
byte for byte on every run; the audit commands read it with ``--log``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gpupool.cli.exits import EXIT_OK, InvalidInput
from gpupool.cli.main import Subparsers
from gpupool.cli.scenario_file import ScenarioFileError, load_scenario
from gpupool.core.simulation import ScenarioError, simulate
from gpupool.events import encode_envelope


def register(subparsers: Subparsers) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "simulate",
        help="run a scenario and print its event log (JSON lines)",
        description="Run a scenario (docs/scenarios.md) through the share-pool core with a "
        "simulated clock and print the event log, one JSON envelope per line.",
    )
    parser.add_argument("scenario", type=Path, metavar="SCENARIO.yaml")
    parser.add_argument(
        "--output", "-o", type=Path, metavar="FILE", help="write the log here instead of stdout"
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        scenario = load_scenario(args.scenario)
        log = simulate(scenario)
    except (ScenarioFileError, ScenarioError) as exc:
        raise InvalidInput(str(exc)) from exc
    data = b"".join(encode_envelope(envelope) + b"\n" for envelope in log)
    if args.output is None:
        sys.stdout.flush()
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
    else:
        try:
            args.output.write_bytes(data)
        except OSError as exc:
            raise InvalidInput(f"{args.output}: cannot write: {exc.strerror or exc}") from exc
    return EXIT_OK
