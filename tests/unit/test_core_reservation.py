"""The GPU held for the head while later pods backfill: the one needing least to be freed.

Written for survivors of the mutation run (docs/testing.md): the shortfall sum, its
floors at zero, and the lowest index on ties were not pinned by any test.
"""

from __future__ import annotations

from core_gwt import T0, ref

from gpupool.core.placement import reservation_gpu
from gpupool.core.state import PodState
from gpupool.events import Share


def head(core: int, memory: int) -> PodState:
    return PodState(
        ref=ref("head"),
        node="n",
        policy="share-pool",
        requests=Share(core=1, memory=1),
        limits=Share(core=core, memory=memory),
        priority=0,
        uid="",
        registered_at=T0,
        phase="ready",
    )


def test_the_gpu_with_the_smaller_shortfall_is_reserved() -> None:
    usage = {0: Share(core=60, memory=60), 1: Share(core=30, memory=30)}
    assert reservation_gpu(usage, head(100, 100), []) == 1


def test_a_shortfall_in_one_resource_is_not_offset_by_room_in_the_other() -> None:
    # GPU 0 lacks 20 % compute and has memory to spare; GPU 1 lacks 10 % of each
    usage = {0: Share(core=70, memory=0), 1: Share(core=60, memory=60)}
    assert reservation_gpu(usage, head(50, 50), []) == 0


def test_on_equal_shortfalls_the_lowest_index_is_reserved() -> None:
    usage = {0: Share(core=0, memory=15), 1: Share(core=15, memory=0)}
    assert reservation_gpu(usage, head(90, 90), []) == 0


def test_room_in_one_resource_does_not_offset_a_shortfall_in_the_other_on_either_side() -> None:
    # GPU 0 has plenty of room in one resource and lacks 20 % of the other; GPU 1 lacks
    # 5 % of each (10 % in all): GPU 1 is reserved, whichever resource GPU 0 has room in
    head_pod = head(50, 50)
    short_in_memory = {0: Share(core=0, memory=70), 1: Share(core=55, memory=55)}
    short_in_compute = {0: Share(core=70, memory=0), 1: Share(core=55, memory=55)}
    assert reservation_gpu(short_in_memory, head_pod, []) == 1
    assert reservation_gpu(short_in_compute, head_pod, []) == 1
