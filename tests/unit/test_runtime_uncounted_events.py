"""A projection does not hand the statistics the event types they count nothing for
(``UNCOUNTED_EVENTS``): that shortcut must never lose a count."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpupool.core import State
from gpupool.events import ALL_EVENT_TYPES, PodReady, decode_envelope
from gpupool.runtime.statistics import UNCOUNTED_EVENTS, LogStatistics

GOLDEN = Path(__file__).parents[1] / "golden" / "events"


@pytest.mark.parametrize("event_type", ALL_EVENT_TYPES, ids=lambda t: t.__name__)
def test_statistics_count_nothing_for_the_event_types_a_projection_skips(
    event_type: type,
) -> None:
    envelope = decode_envelope((GOLDEN / f"{event_type.__name__}.json").read_bytes())
    statistics = LogStatistics()
    statistics.observe(State(), envelope, 1)
    if event_type in UNCOUNTED_EVENTS:
        assert statistics == LogStatistics()


def test_the_skipped_event_types_include_pod_ready_and_only_known_event_types() -> None:
    assert PodReady in UNCOUNTED_EVENTS
    assert set(UNCOUNTED_EVENTS) <= set(ALL_EVENT_TYPES)
