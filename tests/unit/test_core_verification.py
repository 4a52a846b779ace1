"""verify checks liveness and optimality too (issue 9, finding 10).

Each log below passed ``gpupool verify`` before: an idle GPU beside a head that fits,
for ever; a preemption of more victims than needed; a deleted pod never released.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
from core_gwt import NODE, T0, Given, Run, Wait, at, gpu_uuid, ref, registered, topology

from gpupool.core import PlanPreemption, decide, evolve
from gpupool.core.state import State
from gpupool.core.verification import check_liveness_and_optimality
from gpupool.events import (
    Assigned,
    Envelope,
    Event,
    PodReady,
    PodRemoved,
    Preempted,
    QosConfig,
    Released,
)

PREEMPT = QosConfig(preempt_enabled=True)


def entries(
    given: Sequence[Given], *decisions: Sequence[Event]
) -> list[tuple[int, list[Envelope]]]:
    """One entry per given event, then one entry per decision (its events together)."""
    log: list[tuple[int, list[Envelope]]] = []
    for item in given:
        time, event = item if isinstance(item, tuple) else (T0, item)
        log.append((len(log) + 1, [Envelope(id=f"e{len(log) + 1}", time=time, event=event)]))
    for decision in decisions:
        seq = len(log) + 1
        log.append(
            (
                seq,
                [Envelope(id=f"e{seq}.{i}", time=at(60), event=e) for i, e in enumerate(decision)],
            )
        )
    return log


def assigned(name: str, gpu: int) -> Assigned:
    return Assigned(pod=ref(name), node=NODE, gpu_index=gpu, gpu_uuid=gpu_uuid(gpu))


def test_an_idle_gpu_beside_a_head_that_fits_until_the_end_is_found() -> None:
    log = entries(topology(1, waiting=[Wait("a", 50)]))
    findings = check_liveness_and_optimality(log)
    assert [(f.seq, f.type, f.pod) for f in findings] == [(len(log), "PodReady", "default/a")]
    assert "until the end of the log" in findings[0].message


def caused_by_the_entry_before(log: list[tuple[int, list[Envelope]]]) -> None:
    """The last entry's envelopes name the one before it as their cause."""
    seq, envelopes = log[-1]
    cause = log[-2][1][-1].id
    log[-1] = (seq, [msgspec.structs.replace(e, causation_id=cause) for e in envelopes])


def test_a_decision_that_leaves_a_fitting_head_waiting_is_found() -> None:
    given = topology(2, waiting=[Wait("a", 100), Wait("b", 100)])
    log = entries(given, [assigned("b", 1)])
    caused_by_the_entry_before(log)
    findings = check_liveness_and_optimality(log)
    assert [f.pod for f in findings] == ["default/a"]
    assert "scheduling decision" in findings[0].message
    # without a cause (a first decision after a start) the end of the log judges it
    uncaused = entries(given, [assigned("b", 1)])
    findings = check_liveness_and_optimality(uncaused)
    assert [f.pod for f in findings] == ["default/a"]
    assert "until the end of the log" in findings[0].message


def test_a_log_served_in_time_has_no_finding() -> None:
    given = topology(2, waiting=[Wait("a", 100), Wait("b", 100)])
    assert check_liveness_and_optimality(entries(given, [assigned("a", 0), assigned("b", 1)])) == []


def victims_of(given: Sequence[Given]) -> list[Event]:
    state = State()
    for index, (time, event) in enumerate(
        item if isinstance(item, tuple) else (T0, item) for item in given
    ):
        evolve(state, Envelope(id=str(index), time=time, event=event))
    return decide(state, PlanPreemption(node=NODE), at(60))


SMALL_AND_LARGE = topology(
    1,
    running=[Run("old-small", 0, 30, since=at(0)), Run("new-large", 0, 70, since=at(10))],
    waiting=[Wait("urgent", 70, priority=5)],
    qos=PREEMPT,
)


def preempted(victim: str) -> Preempted:
    return Preempted(
        victim=ref(victim),
        preemptor=ref("urgent"),
        node=NODE,
        gpu_index=0,
        gpu_uuid=gpu_uuid(0),
        reason="priority",
    )


def test_the_core_preempts_the_smallest_set_not_the_first_that_frees_enough() -> None:
    """A greedy search in preference order takes old-small, then new-large: two victims."""
    assert victims_of(SMALL_AND_LARGE) == [preempted("new-large")]


def test_a_preemption_of_more_victims_than_needed_is_found() -> None:
    larger = entries(SMALL_AND_LARGE, [preempted("old-small"), preempted("new-large")])
    findings = check_liveness_and_optimality(larger)
    assert any("2 victims" in f.message and "1 suffice" in f.message for f in findings), findings
    assert findings[0].seq == len(larger) and findings[0].type == "Preempted"


def test_a_preemption_split_over_entries_as_old_logs_wrote_it_is_judged_as_one() -> None:
    larger = entries(SMALL_AND_LARGE, [preempted("old-small")], [preempted("new-large")])
    assert any("2 victims" in f.message for f in check_liveness_and_optimality(larger))


def test_the_smallest_preemption_is_no_finding() -> None:
    minimal = entries(SMALL_AND_LARGE, [preempted("new-large")])
    assert not [f for f in check_liveness_and_optimality(minimal) if f.type == "Preempted"]


def test_a_victim_set_that_does_not_free_enough_is_found() -> None:
    short = entries(SMALL_AND_LARGE, [preempted("old-small")])
    assert any("does not free enough" in f.message for f in check_liveness_and_optimality(short))


def test_a_pod_deleted_while_holding_a_gpu_and_never_released_is_found() -> None:
    given = topology(1, running=[Run("a", 0, 100)])
    findings = check_liveness_and_optimality(entries(given, [PodRemoved(pod=ref("a"), node=NODE)]))
    assert [(f.type, f.pod) for f in findings] == [("PodRemoved", "default/a")]
    released = entries(
        given,
        [PodRemoved(pod=ref("a"), node=NODE)],
        [Released(pod=ref("a"), node=NODE, reason="cancelled", gpu_index=0)],
    )
    assert check_liveness_and_optimality(released) == []


def raced_log(
    *, cause_of_backfill: str, then_assign_head: bool
) -> list[tuple[int, list[Envelope]]]:
    """r holds the GPU; a (60) heads the queue, c (40) behind it. r's Released makes room for a;
    a decision appended just after it backfills c, caused by ``cause_of_backfill``."""
    given = topology(1, running=[Run("r", 0, 100)], waiting=[Wait("a", 60), Wait("c", 40)])
    log = entries(given)
    ready_of_a = next(
        e.id for _, es in log for e in es if getattr(e.event, "pod", None) == ref("a")
    )
    release = Envelope(
        id="release-r",
        time=at(30),
        event=Released(pod=ref("r"), node=NODE, reason="completed", exit_code=0, gpu_index=0),
    )
    log.append((len(log) + 1, [release]))
    cause = {"ready-of-a": ready_of_a, "release": release.id, "none": ""}[cause_of_backfill]
    backfill = Envelope(id="backfill-c", time=at(31), event=assigned("c", 0), causation_id=cause)
    log.append((len(log) + 1, [backfill]))
    if then_assign_head:
        head = Envelope(id="assign-a", time=at(32), event=assigned("a", 0), causation_id=release.id)
        log.append((len(log) + 1, [head]))
    return log


def test_a_decision_that_reacted_to_an_entry_before_the_room_was_made_is_judged_by_the_next() -> (
    None
):
    """Its expectation covered only claims: the Released appended meanwhile did not refuse it."""
    log = raced_log(cause_of_backfill="ready-of-a", then_assign_head=True)
    assert check_liveness_and_optimality(log) == []


def test_a_raced_decision_not_followed_by_one_that_serves_the_head_is_found_at_the_end() -> None:
    log = raced_log(cause_of_backfill="ready-of-a", then_assign_head=False)
    findings = check_liveness_and_optimality(log)
    assert [f.pod for f in findings] == ["default/a"]
    assert "until the end of the log" in findings[0].message


def test_a_first_decision_after_a_restart_racing_a_release_is_judged_by_the_next() -> None:
    """A service's first decisions after it starts name no cause: made from its rebuild,
    which may have ended before the Released that made room. Judged strictly, the entry
    after it (here another pod's PodReady) reported a violation that did not happen."""
    log = raced_log(cause_of_backfill="none", then_assign_head=False)
    ready_d = Envelope(id="ready-d", time=at(31.5), event=PodReady(pod=ref("d"), node=NODE))
    log.append((len(log) + 1, [ready_d]))
    head = Envelope(id="assign-a", time=at(32), event=assigned("a", 0), causation_id="release-r")
    log.append((len(log) + 1, [head]))
    assert check_liveness_and_optimality(log) == []
    # and one that is never followed by a decision serving the head is still found
    unserved = raced_log(cause_of_backfill="none", then_assign_head=False)
    unserved.append((len(unserved) + 1, [ready_d]))
    findings = check_liveness_and_optimality(unserved)
    assert [f.pod for f in findings] == ["default/a"]
    assert "until the end of the log" in findings[0].message


def test_a_decision_that_knew_of_the_room_and_left_the_head_waiting_is_found() -> None:
    log = raced_log(cause_of_backfill="release", then_assign_head=False)
    findings = check_liveness_and_optimality(log)
    assert [f.pod for f in findings] == ["default/a"]
    assert "scheduling decision" in findings[0].message


def ready_while_in_flight_log(*, cause_of_first: str) -> list[tuple[int, list[Envelope]]]:
    """Two GPUs; a (50) waits, b and c (50 each) are registered. b's PodReady is appended
    while the decision that assigns a is in flight (its expectation covers only claims: the
    PodReady does not refuse it), so that decision leaves b, the head after a, fitting; c's
    PodReady comes before the admission-queue's reaction to b's, which assigns b and c
    (caused by c's). ``cause_of_first``: what the decision assigning a reacted to."""
    given = [*topology(2, waiting=[Wait("a", 50)]), registered("b", 1, 50), registered("c", 1, 50)]
    log = entries(given)
    ready_of_a = next(e.id for _, es in log for e in es if isinstance(e.event, PodReady))
    ready = {
        name: Envelope(id=f"ready-{name}", time=at(30), event=PodReady(pod=ref(name), node=NODE))
        for name in ("b", "c")
    }
    log.append((len(log) + 1, [ready["b"]]))
    cause = {"ready-of-a": ready_of_a, "ready-of-b": "ready-b", "none": ""}[cause_of_first]
    first = Envelope(id="assign-a", time=at(31), event=assigned("a", 0), causation_id=cause)
    log.append((len(log) + 1, [first]))
    log.append((len(log) + 1, [ready["c"]]))
    reaction = [
        Envelope(
            id=f"assign-{name}", time=at(32), event=assigned(name, gpu), causation_id="ready-c"
        )
        for name, gpu in (("b", 0), ("c", 1))
    ]
    log.append((len(log) + 1, reaction))
    return log


def test_a_decision_that_leaves_a_head_readied_while_it_was_in_flight_is_judged_by_the_next() -> (
    None
):
    """The chaos run's finding (CI, commit 32000be: "a scheduling decision ... left the head
    default/p1 waiting although GPU 1 has room for it"): a decision whose own entry makes the
    head fit was judged strictly, as if it had known of that head, though the head's PodReady
    came after the entry it reacted to; the executor's next entry, before the reaction to the
    PodReady, was reported as a violation that did not happen."""
    for cause in ("ready-of-a", "none"):
        assert check_liveness_and_optimality(ready_while_in_flight_log(cause_of_first=cause)) == []


def test_a_decision_that_leaves_a_head_readied_before_its_cause_waiting_is_found() -> None:
    log = ready_while_in_flight_log(cause_of_first="ready-of-b")
    findings = check_liveness_and_optimality(log)
    assert [f.pod for f in findings] == ["default/b"]
    assert "scheduling decision" in findings[0].message
    # and a head readied while it was in flight, never served, is found at the end
    unserved = ready_while_in_flight_log(cause_of_first="ready-of-a")[:-1]
    findings = check_liveness_and_optimality(unserved)
    assert [f.pod for f in findings] == ["default/b"]
    assert "until the end of the log" in findings[0].message
