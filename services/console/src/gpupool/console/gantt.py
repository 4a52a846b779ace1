"""The GPU timeline as an SVG Gantt chart, drawn server-side by matplotlib.

One row per GPU (``node/GPU n``), one bar per :class:`~gpupool.audit.GpuInterval`
(from ``Assigned`` to its release), labelled with the pod; a bar that ended in a
preemption is hatched and its preemption marked with a red ``x`` at the moment of
the ``Preempted``; a bar still held at the window's end is drawn to the end. Each
bar carries an SVG id (``interval-<n>``) so that tests and stylesheets can find it.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from datetime import datetime, timedelta

from matplotlib.figure import Figure

from gpupool.audit import GpuInterval

ROW_HEIGHT_IN = 0.55
COLOURS = ("#4c78a8", "#f58518", "#54a24b", "#b279a2", "#e45756", "#72b7b2", "#eeca3b")


def row_key(interval: GpuInterval) -> tuple[str, int]:
    return (interval.node, interval.gpu_index)


def gantt_svg(intervals: Sequence[GpuInterval], start: datetime, end: datetime) -> str:
    """An SVG document: who held each GPU when, over [start, end]; x in seconds from start."""
    rows = sorted({row_key(i) for i in intervals})
    span = max((end - start).total_seconds(), 1.0)
    figure = Figure(figsize=(10, 1.2 + ROW_HEIGHT_IN * max(len(rows), 1)), dpi=100)
    axes = figure.add_subplot()
    pods = sorted({str(i.pod) for i in intervals})
    colour = {pod: COLOURS[n % len(COLOURS)] for n, pod in enumerate(pods)}
    for number, interval in enumerate(intervals):
        row = rows.index(row_key(interval))
        left = max((interval.start - start).total_seconds(), 0.0)
        right = (interval.end - start).total_seconds() if interval.end is not None else span
        bars = axes.broken_barh(
            [(left, max(right - left, span / 400))],
            (row - 0.35, 0.7),
            facecolors=colour[str(interval.pod)],
            edgecolor="black",
            linewidth=0.6,
            hatch="//" if interval.ended == "preempted" else None,
        )
        bars.set_gid(f"interval-{number}")
        axes.text(
            left + (right - left) / 2,
            row,
            interval.pod.name,
            ha="center",
            va="center",
            fontsize=8,
            color="white",
            clip_on=True,
        )
        if interval.preempted_at is not None:
            axes.plot(
                [(interval.preempted_at - start).total_seconds()],
                [row + 0.42],
                marker="x",
                color="#d62728",
                markersize=9,
                markeredgewidth=2,
                gid=f"preempted-{number}",
            )
    axes.set_yticks(range(len(rows)), [f"{node} / GPU {gpu}" for node, gpu in rows], fontsize=8)
    axes.set_ylim(-0.6, max(len(rows), 1) - 0.4)
    axes.invert_yaxis()
    axes.set_xlim(0, span)
    axes.set_xlabel(f"seconds from {start.strftime('%Y-%m-%d %H:%M:%S')} UTC", fontsize=8)
    axes.grid(axis="x", linestyle=":", linewidth=0.5)
    figure.tight_layout()
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg")
    text = buffer.getvalue()
    return text[text.index("<svg") :]


def window(intervals: Sequence[GpuInterval], now: datetime) -> tuple[datetime, datetime]:
    """The whole span of the intervals (at least a minute), ending ``now`` if one is held."""
    if not intervals:
        return now - timedelta(minutes=1), now
    start = min(i.start for i in intervals)
    ends = [i.end for i in intervals if i.end is not None]
    end = now if any(i.end is None for i in intervals) or not ends else max(ends)
    return start, max(end, start + timedelta(seconds=1))
