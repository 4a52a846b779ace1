"""Every entry is checked against the state before it is believed (gpupool.core.admission_check).

Issue 12: fuzzed messages that happened to be valid ``Assigned`` (unknown pods, GPU
indexes past the inventory) were applied; an old ``Released`` appended again under a
new message id ended a running job; an old ``PodReady`` appended again after the
duplicate window gave a GPU to a pod with no client. Each is refused here: not
folded, recorded once as a MessageRejected naming the reason, not reacted to, and
``gpupool verify`` reports the replays.
"""

from __future__ import annotations

import uuid

import msgspec
from core_gwt import NODE, at, gpu_uuid, node_events, ref, registered

from gpupool.cli.audit import verify
from gpupool.core import RequestGpu, Schedule, State, evolve
from gpupool.core.admission_check import MAX_REMEMBERED_IDS, EnvelopeIds, admission_problem
from gpupool.eventlog import InMemoryEventLog
from gpupool.eventlog.port import StoredEvent, read_entries
from gpupool.eventlog.subjects import subject_for
from gpupool.events import (
    Assigned,
    Envelope,
    Event,
    MessageRejected,
    PodReady,
    Released,
    encode_envelope,
)
from gpupool.runtime.decider import DeciderLoop
from gpupool.runtime.projection import Projection
from gpupool.runtime.snapshot import decode_snapshot, encode_snapshot


def envelope(event: Event, *, seconds: float = 0) -> Envelope:
    return Envelope(id=uuid.uuid4().hex, time=at(seconds), event=event)


async def replay_raw(log: InMemoryEventLog, old: Envelope) -> int:
    """Append an entry again as it was, past any duplicate window (a new message id)."""
    return await log.append_raw(subject_for(old.event), encode_envelope(old))


async def rejections(log: InMemoryEventLog) -> dict[int, str]:
    found: dict[int, str] = {}
    async for entry in log.replay():
        if isinstance(entry, StoredEvent) and isinstance(entry.envelope.event, MessageRejected):
            assert entry.envelope.event.seq not in found, "recorded twice"
            found[entry.envelope.event.seq] = entry.envelope.event.reason
    return found


async def given(log: InMemoryEventLog, events: list[Event]) -> list[Envelope]:
    envelopes = [envelope(event) for event in events]
    for item in envelopes:
        await log.append(item)
    return envelopes


async def test_an_assigned_for_an_unknown_pod_or_gpu_is_recorded_and_not_applied(
    memory_log: InMemoryEventLog,
) -> None:
    await given(memory_log, [*node_events(1), registered("a", 50)])
    executor = DeciderLoop(memory_log, service="node-executor")
    await executor.rebuild()
    await executor.execute(RequestGpu(pod=ref("a"), node=NODE), node=NODE)
    ghost = await memory_log.append(
        envelope(Assigned(pod=ref("ghost"), node=NODE, gpu_index=0, gpu_uuid=gpu_uuid(0)))
    )
    beyond = await memory_log.append(
        envelope(Assigned(pod=ref("a"), node=NODE, gpu_index=5, gpu_uuid="GPU-5"))
    )
    admission = DeciderLoop(memory_log, service="admission-queue")
    await admission.rebuild()
    assert admission.projection.state.pods[ref("a")].phase == "ready"
    assert ref("ghost") not in admission.projection.state.pods
    found = await rejections(memory_log)
    assert found[ghost].startswith("UnknownPod: default/ghost is not registered")
    assert found[beyond].startswith(f"UnknownGpu: node {NODE} has no GPU 5")
    # the pod is scheduled on the GPU the node has; a second service records nothing again
    assert [type(e) for e in await admission.execute(Schedule(node=NODE), node=NODE)] == [Assigned]
    again = DeciderLoop(memory_log, service="preemption")
    await again.rebuild()
    assert await rejections(memory_log) == found


async def test_an_old_released_appended_again_does_not_end_the_running_job(
    memory_log: InMemoryEventLog,
) -> None:
    envelopes = await given(
        memory_log,
        [
            *node_events(1),
            registered("a", 50),
            PodReady(pod=ref("a"), node=NODE),
            Assigned(pod=ref("a"), node=NODE, gpu_index=0, gpu_uuid=gpu_uuid(0)),
            Released(pod=ref("a"), node=NODE, reason="completed", gpu_index=0, exit_code=0),
            PodReady(pod=ref("a"), node=NODE),
            Assigned(pod=ref("a"), node=NODE, gpu_index=0, gpu_uuid=gpu_uuid(0)),
        ],
    )
    old_release = envelopes[-3]
    executor = DeciderLoop(memory_log, service="node-executor")
    await executor.rebuild()
    reacted: list[Event] = []

    async def react(entry: StoredEvent) -> None:
        reacted.append(entry.envelope.event)

    seq = await replay_raw(memory_log, old_release)
    consuming = DeciderLoop(memory_log, service="node-executor", projection=executor.projection)
    delivered = memory_log.subscribe(durable="check", from_seq=seq)
    async with delivered:
        async for delivery in delivered:
            assert await consuming._take(delivery.entry) is False
            await delivery.ack()
            break
    pod = consuming.projection.state.pods[ref("a")]
    assert (pod.phase, pod.gpu_index) == ("running", 0)
    found = await rejections(memory_log)
    assert found[seq].startswith(f"ReplayedEnvelope: envelope {old_release.id} was applied before")
    assert reacted == []


async def test_an_old_pod_ready_appended_after_the_window_gives_no_gpu(
    memory_log: InMemoryEventLog,
) -> None:
    envelopes = await given(
        memory_log,
        [
            *node_events(1),
            registered("a", 50),
            PodReady(pod=ref("a"), node=NODE),
            Assigned(pod=ref("a"), node=NODE, gpu_index=0, gpu_uuid=gpu_uuid(0)),
            Released(pod=ref("a"), node=NODE, reason="completed", gpu_index=0, exit_code=0),
        ],
    )
    seq = await replay_raw(memory_log, envelopes[-3])  # the client is long gone
    admission = DeciderLoop(memory_log, service="admission-queue")
    await admission.rebuild()
    assert admission.projection.state.pods[ref("a")].phase == "dormant"
    assert await admission.execute(Schedule(node=NODE), node=NODE) == []
    assert (await rejections(memory_log))[seq].startswith("ReplayedEnvelope")


def test_replays_are_recognised_after_a_snapshot_and_the_index_is_bounded() -> None:
    events: list[Event] = [*node_events(1), registered("a", 50), PodReady(pod=ref("a"), node=NODE)]
    envelopes = [envelope(event) for event in events]
    projection = Projection()
    for seq, item in enumerate(envelopes, start=1):
        projection.apply(seq, item)
    assert projection.take_refused() == []
    resumed = Projection.from_snapshot(decode_snapshot(encode_snapshot(projection.to_snapshot())))
    resumed.apply(len(envelopes) + 1, envelopes[-1])
    (refused,) = resumed.take_refused()
    assert refused.reason.startswith("ReplayedEnvelope")

    ids = EnvelopeIds()
    for number in range(MAX_REMEMBERED_IDS + 10):
        ids.add(f"e{number}")
    assert len(ids) == MAX_REMEMBERED_IDS
    assert "e0" not in ids and "e9" not in ids and "e10" in ids
    assert f"e{MAX_REMEMBERED_IDS + 9}" in ids


def test_a_log_the_services_wrote_folds_with_nothing_refused() -> None:
    events: list[Event] = [
        *node_events(2),
        registered("a", 50),
        registered("s", 50, policy="static"),
        Assigned(pod=ref("s"), node=NODE, gpu_index=1, gpu_uuid=gpu_uuid(1)),
        PodReady(pod=ref("a"), node=NODE),
        Released(pod=ref("a"), node=NODE, reason="cancelled"),
        PodReady(pod=ref("a"), node=NODE),
        Assigned(pod=ref("a"), node=NODE, gpu_index=0, gpu_uuid=gpu_uuid(0)),
        Released(pod=ref("a"), node=NODE, reason="completed", gpu_index=0, exit_code=0),
    ]
    state = State()
    ids = EnvelopeIds()
    for item in (envelope(event) for event in events):
        assert admission_problem(state, item, ids) is None, item.event
        evolve(state, item)
        ids.add(item.id)


def test_verify_reports_an_entry_appended_again() -> None:
    envelopes = [
        envelope(event)
        for event in [
            *node_events(1),
            registered("a", 50),
            PodReady(pod=ref("a"), node=NODE),
            Assigned(pod=ref("a"), node=NODE, gpu_index=0, gpu_uuid=gpu_uuid(0)),
            Released(pod=ref("a"), node=NODE, reason="completed", gpu_index=0, exit_code=0),
            PodReady(pod=ref("a"), node=NODE),
            Assigned(pod=ref("a"), node=NODE, gpu_index=0, gpu_uuid=gpu_uuid(0)),
        ]
    ]
    old_release = envelopes[4]
    entries = [
        entry
        for seq, item in enumerate([*envelopes, old_release], start=1)
        for entry in read_entries(seq, subject_for(item.event), encode_envelope(item))
    ]
    report = verify(entries)
    replays = [v for v in report.violations if "ReplayedEnvelope" in v.message]
    assert [(v.seq, v.id, v.pod) for v in replays] == [
        (len(envelopes) + 1, old_release.id, "default/a")
    ]
    assert msgspec.to_builtins(report)["violations"]


def test_a_second_registration_of_a_registered_pod_does_not_reset_it() -> None:
    projection = Projection()
    events: list[Event] = [
        *node_events(1),
        registered("a", 50),
        PodReady(pod=ref("a"), node=NODE),
        Assigned(pod=ref("a"), node=NODE, gpu_index=0, gpu_uuid=gpu_uuid(0)),
        registered("a", 50),  # a new id: no replay, but the pod is running
    ]
    for seq, item in enumerate((envelope(event) for event in events), start=1):
        projection.apply(seq, item)
    (refused,) = projection.take_refused()
    assert refused.reason.startswith("EventOutOfOrder: default/a is already registered")
    assert projection.state.pods[ref("a")].phase == "running"
