"""How the audit commands read and write times: RFC3339 instants and offsets like ``+1m05s``.

The rules live in ``gpupool.audit.times`` (the console uses them too); here a time
that cannot be read is invalid input (exit 2).
"""

from __future__ import annotations

from datetime import datetime

from gpupool.audit import times
from gpupool.audit.times import format_duration, format_offset, format_time
from gpupool.cli.exits import InvalidInput

__all__ = ["MomentError", "format_duration", "format_offset", "format_time", "parse_moment"]


class MomentError(InvalidInput, ValueError):
    """The text is neither an RFC3339 time nor an offset like ``+65s``."""


def parse_moment(text: str, origin: datetime | None) -> datetime:
    """An RFC3339 time, or an offset from ``origin`` (the log's first entry): +65s, +1m05s, +2h, +65."""
    try:
        return times.parse_moment(text, origin)
    except times.MomentError as exc:
        raise MomentError(str(exc)) from exc
