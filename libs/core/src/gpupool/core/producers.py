"""Which service may produce which event: an event from any other writer is not believed (pure).

Every entry of the log names the service that appended it: the last token of its
subject (``<prefix>.<node>.<writer>``, docs/eventlog.md "Subjects"). NATS lets each
service's credential publish only on its own writer's subjects, so the token says
who appended the entry; :func:`producer_problem` says whether that service is one
that appends such an event at all. The table is what the services actually append
(``decide`` for the commands each one executes, and the rejections every service
sets aside):

* **policy** (ConfigureNode, RegisterPod, RemovePod, ReconcilePods): the node and pod
  registrations, and the ``Assigned`` that binds a static pod at registration;
* **admission-queue** (Schedule): ``Assigned``;
* **preemption** (PlanPreemption): ``Preempted``;
* **node-executor** (ReportInventory, RequestGpu, ReportRelease): the inventory,
  ``PodReady``, ``Released``, a ``PodRejected`` of a request it cannot serve, and the
  ``Assigned`` of static pods (bound when the inventory arrives, or again on request);
* any of them: ``MessageRejected`` (an entry set aside).

Writers that prove nothing are read as before, never refused:

* ``gpupool`` (``DEFAULT_WRITER``: tools, benchmarks, tests) and ``simulator`` (the
  subjects shown for a JSON-lines log): no service credential may publish on them,
  so on an authenticated deployment nobody can append under them;
* a **legacy** subject, written before the writer token, whose last token is the
  entry's event tag or ``Decision``: the writer is unknown. Such logs fold as they
  always did; no credential may publish on those subjects either.
* no writer at all (``None``: a caller that does not know the subject).

Any other token — an unknown writer, or a known one appending an event it never
appends — is refused: ``UnknownProducer`` / ``WrongProducer``.
"""

from __future__ import annotations

from gpupool.events import (
    ALL_EVENT_TYPES,
    Assigned,
    Event,
    GpuInventoryReported,
    MessageRejected,
    NodeConfigured,
    NodeDisabled,
    NodeRejected,
    PodReady,
    PodRegistered,
    PodRejected,
    PodRemoved,
    Preempted,
    Released,
)

UNKNOWN_PRODUCER = "UnknownProducer"
WRONG_PRODUCER = "WrongProducer"

POLICY = "policy"
ADMISSION_QUEUE = "admission-queue"
PREEMPTION = "preemption"
NODE_EXECUTOR = "node-executor"

UNATTRIBUTED_WRITERS = frozenset({"gpupool", "simulator"})
"""Writer tokens of appends outside the services (``DEFAULT_WRITER``, ``SIMULATOR_WRITER``)."""

LEGACY_DECISION_TOKEN = "Decision"

PRODUCERS: dict[str, frozenset[type[Event]]] = {
    POLICY: frozenset(
        {
            NodeConfigured,
            NodeDisabled,
            NodeRejected,
            PodRegistered,
            PodRejected,
            PodRemoved,
            Assigned,
            MessageRejected,
        }
    ),
    ADMISSION_QUEUE: frozenset({Assigned, MessageRejected}),
    PREEMPTION: frozenset({Preempted, MessageRejected}),
    NODE_EXECUTOR: frozenset(
        {GpuInventoryReported, PodReady, Released, PodRejected, Assigned, MessageRejected}
    ),
}
"""Writer token -> the events that service appends (docs/eventlog.md, "Who writes what")."""


def _tag(event_type: type[Event]) -> str:
    tag = event_type.__struct_config__.tag
    assert isinstance(tag, str)
    return tag


LEGACY_TOKENS = frozenset({_tag(t) for t in ALL_EVENT_TYPES} | {LEGACY_DECISION_TOKEN})
"""The last tokens of subjects written before the writer token (an event tag, ``Decision``)."""

_WRITERS_OF: dict[type[Event], str] = {
    event_type: ", ".join(w for w, events in PRODUCERS.items() if event_type in events)
    for event_type in ALL_EVENT_TYPES
}


def producer_problem(event: Event, writer: str | None) -> str | None:
    """``"<Reason>: <message>"`` if ``writer`` may not have produced ``event``; None if it may."""
    if writer is None:
        return None
    allowed = PRODUCERS.get(writer)
    if allowed is None:
        if writer in UNATTRIBUTED_WRITERS or writer in LEGACY_TOKENS:
            return None
        return (
            f"{UNKNOWN_PRODUCER}: {_tag(type(event))} was appended by {writer!r}, "
            "which is not a gpupool service"
        )
    if type(event) in allowed:
        return None
    return (
        f"{WRONG_PRODUCER}: {_tag(type(event))} is appended only by "
        f"{_WRITERS_OF[type(event)]}, not by {writer}"
    )


def believed_events(writer: str | None) -> frozenset[type[Event]]:
    """The event types :func:`producer_problem` believes from ``writer`` (finds no problem with)."""
    if writer is None:
        return frozenset(ALL_EVENT_TYPES)
    allowed = PRODUCERS.get(writer)
    if allowed is not None:
        return allowed
    if writer in UNATTRIBUTED_WRITERS or writer in LEGACY_TOKENS:
        return frozenset(ALL_EVENT_TYPES)
    return frozenset()
