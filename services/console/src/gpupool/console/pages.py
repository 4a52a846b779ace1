"""What each page shows, computed from the feed's entries with the audit read models.

Each function returns the template name and its context: the HTTP layer
(``app.py``) renders them, the same way for the first response and for each live
update pushed by server-sent events.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from gpupool.audit import (
    AuditError,
    gpu_intervals,
    log_origin,
    parse_pod,
    pod_history,
    preemptions,
    state_at,
)
from gpupool.audit.describe import qos_text, share_text, step_text
from gpupool.audit.times import format_duration, format_offset, format_time, parse_moment
from gpupool.console.gantt import gantt_svg, window
from gpupool.eventlog.port import Entry


@dataclass(frozen=True)
class Page:
    template: str
    """The live part of the page (``<name>.html``; the full page is ``<name>_page.html``)."""
    title: str
    context: dict[str, Any]


HELPERS = {
    "share": share_text,
    "qos": qos_text,
    "duration": format_duration,
    "offset": format_offset,
    "time": format_time,
    "step_text": step_text,
}


def clock() -> datetime:
    """The live pages measure waits against this clock, not the log's last entry."""
    return datetime.now(UTC)


def cluster_page(entries: Sequence[Entry], now: datetime) -> Page:
    if log_origin(entries) is None:
        return Page("cluster", "cluster", {"view": None, "now": now})
    view = state_at(entries, now)
    rows = []
    for node in view.nodes:
        used_core = sum(g.used.core for g in node.gpus)
        used_memory = sum(g.used.memory for g in node.gpus)
        rows.append(
            {
                "node": node,
                "running": sum(len(g.pods) for g in node.gpus),
                "capacity": 100 * len(node.gpus),
                "used_core": used_core,
                "used_memory": used_memory,
            }
        )
    return Page("cluster", "cluster", {"view": view, "rows": rows, "now": now})


def node_page(entries: Sequence[Entry], name: str, now: datetime) -> Page:
    view = state_at(entries, now, name)
    (node,) = view.nodes
    return Page(
        "node",
        f"node {name}",
        {"view": view, "node": node, "now": now, "origin": view.origin},
    )


def pod_page(entries: Sequence[Entry], name: str, now: datetime) -> Page:
    ref = parse_pod(name)
    history = pod_history(entries, ref)
    intervals = [i for i in gpu_intervals(entries, node=history.node) if i.pod == ref]
    return Page(
        "pod",
        f"pod {ref}",
        {"history": history, "intervals": intervals, "now": now, "origin": history.origin},
    )


def gpus_page(
    entries: Sequence[Entry],
    now: datetime,
    *,
    node: str | None = None,
    since: str | None = None,
    until: str | None = None,
) -> Page:
    origin = log_origin(entries)
    if origin is None:
        raise AuditError("the log has no readable entries")
    start = parse_moment(since, origin) if since else None
    end = parse_moment(until, origin) if until else None
    intervals = gpu_intervals(entries, node=node, since=start, until=end)
    low, high = window(intervals, end or now)
    low = start or low
    high = end or high
    chart = gantt_svg(intervals, low, high)
    return Page(
        "gpus",
        "GPU timeline",
        {
            "intervals": intervals,
            "preemptions": [
                p for p in preemptions(entries, node=node) if (end is None or p.time <= end)
            ],
            "chart": chart,
            "origin": origin,
            "node": node or "",
            "since": since or "",
            "until": until or "",
            "now": now,
            "live": end is None,
        },
    )
