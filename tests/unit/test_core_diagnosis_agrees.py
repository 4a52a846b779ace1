"""The diagnosis says what the services then did: before every queue ``Assigned`` of a long
random simulated log it says ``assigned-next-pass`` on that GPU, and before every
``Preempted`` it says ``preemption-due`` for that preemptor, GPU and victim.

The logs come from the core's simulator (``decide`` driven like the services drive
it), so this checks that ``diagnose`` and the decisions actually logged agree.
"""

from __future__ import annotations

import pytest
from observability_logs import random_log

from gpupool.core import State, evolve
from gpupool.core.diagnosis import diagnose
from gpupool.events import Assigned, Preempted


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_diagnosis_predicts_every_assignment_and_preemption(seed: int) -> None:
    state = State()
    checked = {"assigned": 0, "preempted": 0}
    for _seq, envelope, _node in random_log(seed):
        if envelope is None:
            continue
        event = envelope.event
        if isinstance(event, Assigned):
            pod = state.pods.get(event.pod)
            if pod is not None and pod.phase == "ready":
                diagnosis = diagnose(state, event.pod, envelope.time)
                assert diagnosis.verdict == "assigned-next-pass", (envelope, diagnosis)
                assert diagnosis.assigned_gpu == event.gpu_index, (envelope, diagnosis)
                checked["assigned"] += 1
        elif isinstance(event, Preempted):
            diagnosis = diagnose(state, event.preemptor, envelope.time)
            already = [v for v, _gpu, by in diagnosis.evicting if by == event.preemptor]
            if already:
                # the second victim of one plan: the first one's Preempted is folded already
                assert diagnosis.verdict == "preemption-under-way"
            else:
                assert diagnosis.verdict == "preemption-due", (envelope, diagnosis)
                assert diagnosis.plan is not None
                assert diagnosis.plan.gpu_index == event.gpu_index
                assert event.victim in [v.pod.ref for v in diagnosis.plan.victims]
            checked["preempted"] += 1
        evolve(state, envelope)
    assert checked["assigned"] > 50 and checked["preempted"] > 0, checked
