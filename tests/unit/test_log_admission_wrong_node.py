"""An event naming another node than its pod's is not believed (admission_check ``WrongNode``).

Such an entry lies on the named node's subjects (node B's executor credential may write
there): a whole-log reader folding it into node A's pod would see what A's partitioned
executor never sees (it reads A's subjects only), and the two views of A would split —
a GPU freed for the admission-queue while A's executor still runs the job. It is refused
by every reader, so both views of A stay the same; ``gpupool verify`` reports it.
"""

from __future__ import annotations

import uuid

import pytest
from core_gwt import at, gpu_uuid, node_events, ref, registered

from gpupool.cli.audit import verify
from gpupool.core import State
from gpupool.eventlog import InMemoryEventLog
from gpupool.eventlog.port import StoredEvent, read_entries
from gpupool.eventlog.subjects import subject_for
from gpupool.events import (
    Assigned,
    Envelope,
    Event,
    MessageRejected,
    PodReady,
    PodRemoved,
    Preempted,
    Released,
    encode_envelope,
    event_node,
)
from gpupool.runtime.decider import DeciderLoop
from gpupool.runtime.projection import Projection

A, B = "gpu-a.example", "gpu-b.example"


def envelope(event: Event) -> Envelope:
    return Envelope(id=uuid.uuid4().hex, time=at(), event=event)


def history() -> list[Event]:
    """Node A runs pod ``run``, pod ``wait`` is in A's queue; node B runs pod ``other``."""
    return [
        *node_events(1, node=A),
        *node_events(1, node=B),
        registered("run", 60, node=A),
        registered("wait", 60, node=A),
        registered("other", 60, node=B),
        registered("idle", 10, node=A),
        PodReady(pod=ref("run"), node=A),
        Assigned(pod=ref("run"), node=A, gpu_index=0, gpu_uuid=gpu_uuid(0, A)),
        PodReady(pod=ref("wait"), node=A),
        PodReady(pod=ref("other"), node=B),
        Assigned(pod=ref("other"), node=B, gpu_index=0, gpu_uuid=gpu_uuid(0, B)),
    ]


CROSSING: dict[str, Event] = {
    "a release of A's running pod": Released(
        pod=ref("run"), node=B, reason="completed", gpu_index=0, exit_code=0
    ),
    "a queue exit of A's waiting pod": Released(
        pod=ref("wait"), node=B, reason="completed", gpu_index=None
    ),
    "a PodReady of A's dormant pod": PodReady(pod=ref("idle"), node=B),
    "a PodRemoved of A's running pod": PodRemoved(pod=ref("run"), node=B),
    "a preemption of A's pod": Preempted(
        victim=ref("run"),
        preemptor=ref("other"),
        node=B,
        gpu_index=0,
        gpu_uuid=gpu_uuid(0, B),
        reason="priority",
    ),
    "a preemption on A for B's pod": Preempted(
        victim=ref("run"),
        preemptor=ref("other"),
        node=A,
        gpu_index=0,
        gpu_uuid=gpu_uuid(0, A),
        reason="priority",
    ),
}


def node_view(state: State, node: str) -> dict[str, tuple[object, ...]]:
    return {
        str(pod.ref): (pod.phase, pod.gpu_index, pod.evicted_by, pod.removed)
        for pod in state.pods.values()
        if pod.node == node
    }


@pytest.mark.parametrize("what", sorted(CROSSING))
def test_an_event_for_a_pod_of_another_node_is_refused_and_the_views_stay_the_same(
    what: str,
) -> None:
    envelopes = [envelope(event) for event in [*history(), CROSSING[what]]]
    whole, partition = Projection(), Projection()
    for seq, item in enumerate(envelopes, start=1):
        whole.apply(seq, item)
        if event_node(item.event) == A:  # what A's partitioned executor is handed
            partition.pass_below(seq)
            partition.apply(seq, item)
    (by_whole,) = whole.take_refused()
    assert by_whole.seq == len(envelopes)
    assert by_whole.reason.startswith("WrongNode: default/")
    assert " is registered on gpu-" in by_whole.reason
    # A's executor is handed only an entry on A's subjects; it knows none of B's pods
    assert [r.seq for r in partition.take_refused()] == (
        [len(envelopes)] if event_node(CROSSING[what]) == A else []
    )
    assert node_view(whole.state, A) == node_view(partition.state, A)
    assert node_view(whole.state, A)["default/run"] == ("running", 0, None, False)


def test_verify_reports_an_event_for_a_pod_of_another_node() -> None:
    events = [*history(), CROSSING["a release of A's running pod"]]
    entries = [
        entry
        for seq, item in enumerate((envelope(event) for event in events), start=1)
        for entry in read_entries(seq, subject_for(item.event), encode_envelope(item))
    ]
    report = verify(entries)
    assert [(v.seq, v.pod) for v in report.violations if "WrongNode" in v.message] == [
        (len(events), "default/run")
    ]
    assert any(s.seq == len(events) and "WrongNode" in s.reason for s in report.set_aside)


async def test_a_service_records_the_crossing_entry_as_a_rejection_once(
    memory_log: InMemoryEventLog,
) -> None:
    for event in history():
        await memory_log.append(envelope(event))
    crossing = await memory_log.append(envelope(CROSSING["a release of A's running pod"]))
    for service in ("admission-queue", "preemption"):  # the second finds it recorded
        loop = DeciderLoop(memory_log, service=service)
        await loop.rebuild()
        assert loop.projection.state.pods[ref("run")].phase == "running"
    reasons = [
        entry.envelope.event.reason
        async for entry in memory_log.replay()
        if isinstance(entry, StoredEvent)
        and isinstance(entry.envelope.event, MessageRejected)
        and entry.envelope.event.seq == crossing
    ]
    assert len(reasons) == 1
    assert reasons[0].startswith(f"WrongNode: default/run is registered on {A}, not {B}")
