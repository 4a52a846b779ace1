"""How the read commands print, kubectl-like: ``-o table|wide|json|yaml``, colour only on a
terminal (``NO_COLOR`` honoured), ``--watch`` re-rendering against the clock.

* ``table``: the human layout (the default); ``wide`` adds columns or details.
* ``json`` / ``yaml``: the read model itself (``gpupool.audit``'s structs), encoded by
  msgspec (times RFC3339, durations ISO 8601 like ``PT57S``) or PyYAML.
* Tables are laid out by ``tabulate``; colour and screen clearing come from ``rich``,
  whose console colours only a terminal and honours ``NO_COLOR`` (and ``FORCE_COLOR``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from typing import Any

import msgspec
import tabulate as tabulate_module
import yaml
from rich.console import Console
from rich.text import Text
from tabulate import tabulate

from gpupool.audit import AuditError
from gpupool.cli.exits import InvalidInput
from gpupool.cli.log_source import LogSource, open_log_source, progress_for, read_entries
from gpupool.eventlog.port import Entry

FORMATS = ("table", "wide", "json", "yaml")
WATCH_TICK_S = 1.0
"""With ``--watch``, how often waits are re-measured against the clock when no entry arrives."""


def add_output_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-o",
        "--output",
        choices=FORMATS,
        default="table",
        help="table (default), wide (more columns), json or yaml (the read model itself)",
    )


def add_watch_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--watch",
        "-w",
        action="store_true",
        help="keep following the log and print again on every new entry (and every second, "
        "waits measured against the clock)",
    )


def clock() -> datetime:
    """Live commands measure time against this clock, not the log's last entry."""
    return datetime.now(UTC)


@contextlib.contextmanager
def audit_errors() -> Iterator[None]:
    """A question the log cannot answer is invalid input: exit 2 with the reason."""
    try:
        yield
    except AuditError as exc:
        raise InvalidInput(str(exc)) from exc


def to_builtins(value: Any) -> Any:
    return msgspec.to_builtins(value)


def encode(value: Any, output: str) -> str:
    if output == "json":
        return msgspec.json.format(msgspec.json.encode(value)).decode() + "\n"
    if output == "yaml":
        return yaml.safe_dump(to_builtins(value), sort_keys=False, allow_unicode=True)
    raise ValueError(f"{output} is not a data format")


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Plain columns, two spaces apart, no trailing blanks (tabulate's ``plain`` layout)."""
    tabulate_module.MIN_PADDING = 0  # headers as wide as their text, like the cells
    text = tabulate(
        [list(r) for r in rows], headers=list(headers), tablefmt="plain", disable_numparse=True
    )
    return [line.rstrip() for line in text.splitlines()]


class Printer:
    """Lines to stdout, styled only where the console is a terminal with colour allowed."""

    def __init__(self) -> None:
        self.console = Console(file=sys.stdout, highlight=False, soft_wrap=True)

    @property
    def live(self) -> bool:
        return self.console.is_terminal

    def line(self, text: str, style: str | None = None) -> None:
        if not self.console.is_terminal:
            sys.stdout.write(text + "\n")
            return
        self.console.print(Text(text, style=style or ""), soft_wrap=True)

    def lines(self, lines: Sequence[tuple[str, str | None] | str]) -> None:
        for item in lines:
            if isinstance(item, str):
                self.line(item)
            else:
                self.line(*item)

    def data(self, value: Any, output: str) -> None:
        sys.stdout.write(encode(value, output))

    def clear(self) -> None:
        if self.console.is_terminal:
            self.console.clear()
        else:
            sys.stdout.write("---\n")
        sys.stdout.flush()

    def flush(self) -> None:
        sys.stdout.flush()


Show = Callable[["Printer", list[Entry], datetime | None], None]
"""Render the entries read so far; the moment is the clock's when watching, else None."""


async def watch(
    source: LogSource,
    entries: list[Entry],
    show: Show,
    *,
    printer: Printer,
    tick: float = WATCH_TICK_S,
) -> None:
    """Show now, then again on every new entry and every ``tick`` seconds (clock time)."""
    show(printer, entries, clock())
    printer.flush()
    arrived: asyncio.Queue[Entry] = asyncio.Queue()

    async def follow() -> None:
        last = entries[-1].seq if entries else 0
        async for entry in source.follow(last):
            await arrived.put(entry)

    follower = asyncio.create_task(follow())
    try:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(tick):
                    entries.append(await arrived.get())
            while not arrived.empty():
                entries.append(arrived.get_nowait())
            if follower.done():
                follower.result()  # a failed follow stops the watch with its error
            printer.clear()
            show(printer, entries, clock())
            printer.flush()
    finally:
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower


async def run_read(args: argparse.Namespace, show: Show) -> None:
    """Read the log once and show it; with ``--watch`` keep showing it as the log grows."""
    printer = Printer()
    source = await open_log_source(args)
    try:
        entries = await read_entries(source, progress=progress_for(args))
        with audit_errors():
            if getattr(args, "watch", False):
                await watch(source, entries, show, printer=printer)
            else:
                show(printer, entries, None)
    finally:
        await source.close()
