"""Placement (docs/behaviour.md) and queue order, positions, backfill (section 8), as tables."""

from __future__ import annotations

import pytest
from core_gwt import (
    NODE,
    Run,
    Wait,
    at,
    gpu_uuid,
    gwt,
    ref,
    registered,
    share,
    topology,
)

from gpupool.core import (
    STATUS_DORMANT,
    STATUS_READY,
    STATUS_RUNNING,
    ReportRelease,
    RequestGpu,
    Schedule,
    choose_gpu,
    fits,
    pooling_position,
    pooling_status,
    queue_positions,
    ready_queue,
    waiting_message,
)
from gpupool.events import Assigned, PodReady, Preempted, QosConfig, Released, Share


def assigned(name: str, gpu: int) -> Assigned:
    return Assigned(pod=ref(name), node=NODE, gpu_index=gpu, gpu_uuid=gpu_uuid(gpu))


# (gpus, running, waiting, expected assignments in order)
PLACEMENT = [
    pytest.param(
        1, [Run("a", 0, 60)], [Wait("x", 40)], [("x", 0)], id="limits-sum-exactly-100-fits"
    ),
    pytest.param(1, [Run("a", 0, 60)], [Wait("x", 41)], [], id="limits-sum-101-does-not-fit"),
    pytest.param(
        1, [Run("a", 0, share(60, 10))], [Wait("x", share(41, 10))], [], id="core-over-100-blocks"
    ),
    pytest.param(
        1, [Run("a", 0, share(10, 60))], [Wait("x", share(10, 41))], [], id="memory-over-100-blocks"
    ),
    pytest.param(
        1,
        [Run("a", 0, share(10, 60))],
        [Wait("x", share(90, 40))],
        [("x", 0)],
        id="core-and-memory-each-exactly-100",
    ),
    pytest.param(
        2,
        [Run("a", 0, share(60, 10)), Run("b", 1, share(10, 10))],
        [Wait("x", share(41, 10))],
        [("x", 1)],
        id="core-decides-the-gpu",
    ),
    pytest.param(
        2,
        [Run("a", 0, share(10, 60)), Run("b", 1, share(30, 30))],
        [Wait("x", share(10, 41))],
        [("x", 1)],
        id="memory-decides-the-gpu",
    ),
    pytest.param(
        1, [Run("a", 0, 50)], [Wait("x", 50)], [("x", 0)], id="limits-not-requests-50-beside-50"
    ),
    pytest.param(
        3,
        [Run("a", 0, 20), Run("b", 1, 70), Run("c", 2, 50)],
        [Wait("x", 30)],
        [("x", 1)],
        id="best-fit-fullest-gpu",
    ),
    pytest.param(
        3,
        [Run("a", 0, 20), Run("b", 1, 80), Run("c", 2, 50)],
        [Wait("x", 30)],
        [("x", 2)],
        id="best-fit-among-gpus-it-fits",
    ),
    pytest.param(
        3,
        [Run("a", 0, share(90, 10)), Run("b", 1, share(40, 40))],
        [Wait("x", share(10, 10))],
        [("x", 0)],
        id="best-fit-counts-core-plus-memory",
    ),
    pytest.param(2, [], [Wait("x", 50)], [("x", 0)], id="lowest-index-on-empty-gpus"),
    pytest.param(
        3,
        [Run("a", 1, 40), Run("b", 2, 40)],
        [Wait("x", 50)],
        [("x", 0)],
        id="an-empty-gpu-before-a-full-one-that-would-leave-an-unusable-10",
    ),
    pytest.param(
        3,
        [Run("a", 1, 40), Run("b", 2, 40)],
        [Wait("x", 60)],
        [("x", 1)],
        id="lowest-index-among-equally-full",
    ),
    pytest.param(
        1,
        [Run("a", 0, 50)],
        [Wait("head", 100), Wait("later", 50)],
        [],
        id="strict-head-of-line-blocks-later-pods",
    ),
    pytest.param(
        2,
        [],
        [Wait("x", 100), Wait("y", 100), Wait("z", 100)],
        [("x", 0), ("y", 1)],
        id="served-in-order-until-the-head-does-not-fit",
    ),
    pytest.param(
        1,
        [],
        [Wait("low", 100, priority=0), Wait("high", 100, priority=5)],
        [("high", 0)],
        id="higher-priority-first",
    ),
    pytest.param(
        1,
        [],
        [Wait("first", 100, priority=1), Wait("second", 100, priority=1)],
        [("first", 0)],
        id="fifo-within-a-priority",
    ),
    pytest.param(
        4,
        [],
        [
            Wait("a", 100, priority=0),
            Wait("b", 100, priority=2),
            Wait("c", 100, priority=2),
            Wait("d", 100, priority=1),
        ],
        [("b", 0), ("c", 1), ("d", 2), ("a", 3)],
        id="priority-then-fifo",
    ),
    pytest.param(
        1,
        [],
        [Wait("low", 50, priority=0), Wait("high", 60, priority=1)],
        [("high", 0)],
        id="priority-head-blocks-an-earlier-lower-priority-pod",
    ),
]


@pytest.mark.parametrize(("gpus", "running", "waiting", "expected"), PLACEMENT)
def test_schedule(
    gpus: int, running: list[Run], waiting: list[Wait], expected: list[tuple[str, int]]
) -> None:
    gwt(
        given=topology(gpus, running, waiting),
        when=Schedule(node=NODE),
        then=[assigned(name, gpu) for name, gpu in expected],
    )


@pytest.mark.parametrize(
    ("used", "want", "expected"),
    [
        pytest.param(share(0, 0), share(100, 100), True, id="whole-gpu"),
        pytest.param(share(50, 50), share(50, 50), True, id="exactly-100"),
        pytest.param(share(50, 50), share(51, 50), False, id="core-101"),
        pytest.param(share(50, 50), share(50, 51), False, id="memory-101"),
        pytest.param(share(99, 0), share(1, 100), True, id="each-resource-separately"),
    ],
)
def test_fits(used: Share, want: Share, expected: bool) -> None:
    assert fits(used, want) is expected


def test_choose_gpu_excludes_a_gpu_and_returns_none_when_nothing_fits() -> None:
    usage = {0: share(90), 1: share(50)}
    assert choose_gpu(usage, share(10)) == 0
    assert choose_gpu(usage, share(10), exclude=0) == 1
    assert choose_gpu(usage, share(60)) is None


def test_a_pod_that_becomes_ready_again_after_preemption_queues_behind_those_waiting() -> None:
    # P held GPU 0 for 2 hours; Q and R (same priority) waited; P is preempted for Q.
    qos = QosConfig(preempt_enabled=True, pod_max_duration_minutes=120)
    given = [
        *topology(1, [Run("p", 0, 100)], [Wait("q", 100), Wait("r", 100)], qos=qos),
        (
            at(minutes=120),
            Preempted(
                victim=ref("p"),
                preemptor=ref("q"),
                node=NODE,
                gpu_index=0,
                gpu_uuid=gpu_uuid(0),
                reason="max-duration",
            ),
        ),
        (
            at(minutes=120),
            Released(
                pod=ref("p"), node=NODE, reason="preempted", gpu_index=0, gpu_uuid=gpu_uuid(0)
            ),
        ),
    ]
    state = gwt(given=given, when=Schedule(node=NODE), then=[assigned("q", 0)], now=at(minutes=120))
    assert queue_positions(state, NODE) == {ref("r"): 1}
    state = gwt(
        given=[*given, (at(minutes=120), assigned("q", 0))],
        when=RequestGpu(pod=ref("p"), node=NODE),
        then=[PodReady(pod=ref("p"), node=NODE)],
        now=at(minutes=121),
    )
    assert queue_positions(state, NODE) == {ref("r"): 1, ref("p"): 2}
    assert [pod.ref.name for pod in ready_queue(state, NODE)] == ["r", "p"]


def test_cancelling_a_waiting_pod_moves_those_behind_it_up() -> None:
    given = topology(1, [Run("a", 0, 100)], [Wait("x", 50), Wait("y", 50), Wait("z", 50)])
    state = gwt(
        given=given,
        when=ReportRelease(pod=ref("x"), node=NODE, reason="cancelled"),
        then=[Released(pod=ref("x"), node=NODE, reason="cancelled")],
    )
    assert queue_positions(state, NODE) == {ref("y"): 1, ref("z"): 2}
    assert pooling_status(state.pods[ref("x")]) == STATUS_DORMANT


# --------------------------------------------------------------------------- DCGM values


def test_pooling_status_and_position_values() -> None:
    state = gwt(
        given=[
            *topology(1, [Run("running", 0, 100)], [Wait("first", 50), Wait("second", 50)]),
            registered("dormant", 1, 50),
        ],
        when=Schedule(node=NODE),
        then=[],
    )
    positions = queue_positions(state, NODE)
    values = {
        name: (pooling_status(state.pods[ref(name)]), pooling_position(positions, ref(name)))
        for name in ("dormant", "first", "second", "running")
    }
    assert values == {
        "dormant": (STATUS_DORMANT, 0),
        "first": (STATUS_READY, 1),
        "second": (STATUS_READY, 2),
        "running": (STATUS_RUNNING, 0),
    }
    assert (STATUS_DORMANT, STATUS_READY, STATUS_RUNNING) == (0, 1, 2)


def test_waiting_message_is_the_source_text() -> None:
    source = "You have been waiting for ${1} seconds. Approximate position: ${2}"
    assert waiting_message(30, 2) == source.replace("${1}", "30").replace("${2}", "2")
    assert waiting_message(0, 1) == "You have been waiting for 0 seconds. Approximate position: 1"


# --------------------------------------------------------------------------- backfill

BACKFILL = QosConfig(backfill=True)


@pytest.mark.parametrize(
    ("qos", "expected"),
    [
        pytest.param(QosConfig(), [], id="off-by-default"),
        pytest.param(BACKFILL, [("later", 2)], id="later-pod-starts-on-another-gpu"),
    ],
)
def test_backfill_starts_a_later_pod_away_from_the_heads_reservation(
    qos: QosConfig, expected: list[tuple[str, int]]
) -> None:
    # The head (limit 100) will get GPU 0 (only A's 50 to free): GPU 0 is reserved;
    # "later" (40) fits GPU 0 and GPU 2 and may only take GPU 2.
    running = [Run("a", 0, 50), Run("c", 1, 100), Run("e", 2, 60)]
    gwt(
        given=topology(3, running, [Wait("head", 100), Wait("later", 40)], qos=qos),
        when=Schedule(node=NODE),
        then=[assigned(name, gpu) for name, gpu in expected],
    )


def test_backfill_never_uses_the_reserved_gpu() -> None:
    # The worked example with backfill: B fits only GPU 0, which is D's reservation.
    gwt(
        given=topology(
            2,
            [Run("a", 0, 50), Run("c", 1, 100)],
            [Wait("d", 100), Wait("b", 50)],
            qos=BACKFILL,
        ),
        when=Schedule(node=NODE),
        then=[],
    )


def test_backfill_reserves_the_gpu_a_pending_preemption_frees_for_the_head() -> None:
    # By shortfall the head would be reserved GPU 0 (60 in use); but V on GPU 1 is being
    # preempted for it, so GPU 1 is its reservation and "later" may take GPU 0.
    qos = QosConfig(backfill=True, preempt_enabled=True)
    given = [
        *topology(
            2,
            [Run("x", 0, 60), Run("v", 1, 100)],
            [Wait("head", 100, priority=5), Wait("later", 30)],
            qos=qos,
        ),
        Preempted(
            victim=ref("v"),
            preemptor=ref("head"),
            node=NODE,
            gpu_index=1,
            gpu_uuid=gpu_uuid(1),
            reason="priority",
        ),
    ]
    gwt(given=given, when=Schedule(node=NODE), then=[assigned("later", 0)])


def test_backfill_serves_the_queue_in_order_while_the_head_fits() -> None:
    gwt(
        given=topology(2, [], [Wait("x", 100), Wait("y", 60), Wait("z", 40)], qos=BACKFILL),
        when=Schedule(node=NODE),
        then=[assigned("x", 0), assigned("y", 1), assigned("z", 1)],
    )


def test_schedule_does_nothing_on_a_node_without_gpus_or_not_share_pool() -> None:
    gwt(given=[], when=Schedule(node=NODE), then=[])
    given = topology(1, [], [Wait("x", 50)])
    gwt(given=given[1:], when=Schedule(node=NODE), then=[])  # no inventory reported
