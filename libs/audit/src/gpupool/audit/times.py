"""How times are read and written in the audit views: RFC3339 instants and offsets like
``+1m05s`` from the log's first entry (so ``--at +65s`` and a ``+1m05s`` column agree)."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

from gpupool.audit.errors import AuditError

_OFFSET = re.compile(
    r"\+(?:(?P<h>\d+(?:\.\d+)?)h)?(?:(?P<m>\d+(?:\.\d+)?)m)?(?:(?P<s>\d+(?:\.\d+)?)s?)?"
)


class MomentError(AuditError):
    """The text is neither an RFC3339 time nor an offset like ``+65s``."""


def parse_moment(text: str, origin: datetime | None) -> datetime:
    """An RFC3339 time, or an offset from ``origin`` (the log's first entry): +65s, +1m05s, +2h, +65."""
    text = text.strip()
    if text.startswith("+"):
        match = _OFFSET.fullmatch(text)
        if match is None or text == "+" or not any(match.group(k) for k in ("h", "m", "s")):
            raise MomentError(f"{text!r} is not an offset (examples: +65s, +1m05s, +2h)")
        if origin is None:
            raise MomentError(f"{text!r} is an offset from the first entry, but the log is empty")
        seconds = (
            float(match.group("h") or 0) * 3600
            + float(match.group("m") or 0) * 60
            + float(match.group("s") or 0)
        )
        return origin + timedelta(seconds=seconds)
    try:
        moment = datetime.fromisoformat(text)
    except ValueError as exc:
        raise MomentError(
            f"{text!r} is neither an RFC3339 time (2025-01-01T00:01:05Z) nor an offset (+65s)"
        ) from exc
    if moment.tzinfo is None:
        raise MomentError(f"{text!r} needs a time zone (e.g. a trailing Z for UTC)")
    return moment


def format_time(moment: datetime) -> str:
    """RFC3339 in UTC, with milliseconds only when there are any."""
    utc = moment.astimezone(UTC)
    if utc.microsecond:
        return utc.strftime("%Y-%m-%dT%H:%M:%S.") + f"{utc.microsecond // 1000:03d}Z"
    return utc.strftime("%Y-%m-%dT%H:%M:%SZ")


def format_duration(delta: timedelta) -> str:
    """58s, 1m05s, 2h00m10s; fractions of a second as 1.5s (negative: -3s)."""
    total = delta.total_seconds()
    sign = "-" if total < 0 else ""
    total = abs(total)
    whole = int(total)
    fraction = round(total - whole, 3)
    if fraction >= 1:
        whole, fraction = whole + 1, 0.0
    seconds_text = f"{whole % 60}" if not fraction else f"{whole % 60 + fraction:g}"
    if whole < 60:
        return f"{sign}{seconds_text}s"
    if whole % 60 < 10:
        seconds_text = "0" + seconds_text
    if whole < 3600:
        return f"{sign}{whole // 60}m{seconds_text}s"
    return f"{sign}{whole // 3600}h{whole % 3600 // 60:02d}m{seconds_text}s"


def format_offset(moment: datetime, origin: datetime) -> str:
    """``+1m05s``: the time since the log's first entry (a valid ``--at`` value)."""
    text = format_duration(moment - origin)
    return text if text.startswith("-") else f"+{text}"
