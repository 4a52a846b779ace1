"""The wait estimate: median recent hold × (pods ahead + itself) / GPUs of the node."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from datetime import timedelta

import msgspec

from gpupool.audit.fold import Hold
from gpupool.core import NodeState

RECENT_HOLDS = 20
"""How many of a node's most recent completed assignments the estimate looks at."""


class WaitEstimate(msgspec.Struct, frozen=True, kw_only=True):
    """``wait = median_hold × position / gpus``; ``wait`` is None when no hold completed yet."""

    node: str
    position: int
    gpus: int
    sample: int
    """How many completed holds the median is over."""
    median_hold: timedelta | None
    wait: timedelta | None


def estimate_wait(node: NodeState, position: int, holds: Sequence[Hold]) -> WaitEstimate:
    completed = [hold for hold in holds if hold.node == node.name and hold.reason == "completed"]
    recent = completed[-RECENT_HOLDS:]
    gpus = len(node.gpus) or node.gpu_count
    if not recent or not gpus:
        return WaitEstimate(
            node=node.name, position=position, gpus=gpus, sample=0, median_hold=None, wait=None
        )
    median = timedelta(seconds=statistics.median(h.held.total_seconds() for h in recent))
    return WaitEstimate(
        node=node.name,
        position=position,
        gpus=gpus,
        sample=len(recent),
        median_hold=median,
        wait=median * position / gpus,
    )
