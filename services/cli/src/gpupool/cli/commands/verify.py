"""``gpupool verify``: re-fold the whole log and check every invariant; exit 1 on a violation."""

from __future__ import annotations

import argparse

from gpupool.cli.audit import INVARIANTS, VerifyReport, verify
from gpupool.cli.exits import EXIT_FAILURE, EXIT_OK
from gpupool.cli.log_source import add_log_source_arguments, read_log
from gpupool.cli.main import Subparsers
from gpupool.cli.output import add_output_argument, encode, table, to_builtins


def register(subparsers: Subparsers) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "verify",
        help="check every invariant over the whole log (exit 1 on a violation)",
        description="Fold the whole log and check at every entry: " + "; ".join(INVARIANTS) + ".",
    )
    add_log_source_arguments(parser)
    add_output_argument(parser)
    parser.set_defaults(handler=run)


def _count(number: int, what: str) -> str:
    return f"{number} {what}{'' if number == 1 else 's'}"


def render(report: VerifyReport) -> list[str]:
    lines = [
        f"violation at #{v.seq} (id {v.id}, {v.type}{f', pod {v.pod}' if v.pod else ''}): "
        f"{v.message}"
        for v in report.violations
    ]
    counts = (
        f"{_count(report.entries, 'entry').replace('entrys', 'entries')} "
        f"({report.undecodable} unreadable), {_count(report.nodes, 'node')}, "
        f"{_count(report.pods, 'pod')}, {_count(report.assignments, 'assignment')}, "
        f"{_count(report.preemptions, 'preemption')}, {_count(report.releases, 'release')}"
    )
    if report.ok:
        lines.append(f"verify: OK, {counts}")
        lines.extend(f"  checked: {invariant}" for invariant in INVARIANTS)
    else:
        lines.append(f"verify: FAILED, {_count(len(report.violations), 'violation')}; {counts}")
    lines.extend(f"  set aside #{entry.seq}: {entry.reason[:300]}" for entry in report.set_aside)
    return lines


def violations_table(report: VerifyReport) -> list[str]:
    """``-o wide``: one row a violation, the invariant's message in full."""
    if not report.violations:
        return []
    rows = [(str(v.seq), v.id, v.type, v.pod or "-", v.message) for v in report.violations]
    return table(("SEQ", "ID", "TYPE", "POD", "VIOLATION"), rows)


def as_data(report: VerifyReport) -> dict[str, object]:
    """``-o json|yaml``: the report itself, with its verdict and what was checked."""
    return {"ok": report.ok, **to_builtins(report), "invariants": list(INVARIANTS)}


async def run(args: argparse.Namespace) -> int:
    report = verify(await read_log(args))
    if args.output in ("json", "yaml"):
        print(encode(as_data(report), args.output), end="")
    else:
        lines = render(report)
        if args.output == "wide":
            lines = [*violations_table(report), *lines[len(report.violations) :]]
        print("\n".join(lines))
    return EXIT_OK if report.ok else EXIT_FAILURE
