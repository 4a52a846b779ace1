"""Every logged event is checked against the state before it is folded (pure, deterministic).

An entry that decodes is not yet believed: a fuzzer's valid ``Assigned`` for a pod
nobody registered, a GPU index beyond the node's inventory, or an old ``Released``
appended again under a new message id (past JetStream's duplicate window) would
otherwise be applied — the last one ends a running job. :func:`admission_problem`
says why an envelope cannot be applied to the state; the projection then folds
nothing of it and the service records it as a MessageRejected with that reason.

The rules are what the services never write in correct operation (``gpupool verify``
flags each as a violation), so a log the services wrote folds exactly as before:

* **replays**: an envelope id applied before (the last :data:`MAX_REMEMBERED_IDS`
  ids are kept in :class:`EnvelopeIds`, which the projection owns and snapshots;
  not in the State, which ``decide`` copies; replays of older entries meet the
  per-pod rules below);
* **PodRegistered** for a pod already registered (it would reset a pod holding a GPU);
* **PodReady** for a pod not registered, or not dormant;
* **Assigned** for a pod not registered, registered on another node, not waiting
  (a share-pool pod must be ready; a static pod must hold no other GPU), or on a GPU
  the node does not have (its inventory, or before one its advertised count);
* **Preempted** of a victim not running on that GPU, or for a preemptor not registered;
* **Released** of a pod not registered, of a GPU the pod does not hold, or out of a
  queue the pod is not in;
* **PodReady, Released, Preempted, PodRemoved** naming another node than the pod's
  (:data:`WRONG_NODE`; for Preempted, the victim's or the preemptor's): the entry lies on
  the named node's subjects, which the pod's node-executor does not read, so folding it
  into the pod would split the views of whole-log and partitioned readers.

The fold stays deterministic: the decision depends only on the state and the envelope.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

from gpupool.core.state import NodeState, State
from gpupool.events import (
    Assigned,
    Envelope,
    Event,
    MessageRejected,
    PodReady,
    PodRegistered,
    PodRejected,
    PodRemoved,
    Preempted,
    Released,
)

MAX_REMEMBERED_IDS = 50_000
"""Envelope ids remembered to recognise a replay (about 2 MB of state)."""

REPLAYED = "ReplayedEnvelope"
UNKNOWN_POD = "UnknownPod"
UNKNOWN_GPU = "UnknownGpu"
OUT_OF_ORDER = "EventOutOfOrder"
WRONG_NODE = "WrongNode"


class EnvelopeIds:
    """The ids of the last ``limit`` envelopes applied, oldest first (a bounded FIFO set).

    A set to look an id up and a deque of the same ids in the order they were added (an
    id added again keeps its place): a rebuild adds one per entry and drops the oldest,
    which costs a set and a deque operation each, less than an ``OrderedDict``'s linked
    nodes (about a microsecond per entry of a rebuild)."""

    __slots__ = ("_order", "limit", "members")

    def __init__(self, ids: Iterable[str] = (), *, limit: int = MAX_REMEMBERED_IDS) -> None:
        self.limit = limit
        self.members: set[str] = set()
        """The ids as a set, to look one up without a call (a rebuild asks once per entry);
        only ``add`` changes it."""
        self._order: deque[str] = deque()
        for envelope_id in ids:
            self.add(envelope_id)

    def add(self, envelope_id: str) -> None:
        seen = self.members
        if envelope_id in seen:
            return
        seen.add(envelope_id)
        order = self._order
        order.append(envelope_id)
        if len(order) > self.limit:
            seen.discard(order.popleft())

    def __contains__(self, envelope_id: object) -> bool:
        return envelope_id in self.members

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EnvelopeIds):
            return NotImplemented
        return self._order == other._order

    __hash__ = None  # type: ignore[assignment]  # mutable, like the OrderedDict it was

    def __repr__(self) -> str:
        return f"EnvelopeIds({list(self._order)!r}, limit={self.limit})"

    def to_list(self) -> list[str]:
        return list(self._order)


def admission_problem(
    state: State, envelope: Envelope, applied: EnvelopeIds | None = None
) -> str | None:
    """``"<Reason>: <message>"`` if the envelope must not be applied to ``state``; None if it may.

    ``applied``: the ids applied so far (None: replays are not looked for)."""
    event = envelope.event
    if type(event) is MessageRejected:
        return None  # folded idempotently by its sequence; never refused
    if applied is not None and envelope.id in applied:
        return f"{REPLAYED}: envelope {envelope.id} was applied before (a replay of it)"
    # the most frequent events first, by exact type (the events are final structs): the
    # common case of each costs a lookup or two
    if type(event) is PodReady:
        pod = state.pods.get(event.pod)
        if pod is not None and pod.phase == "dormant" and pod.node == event.node:
            return None
    elif type(event) is Assigned:
        pod = state.pods.get(event.pod)
        if pod is not None and pod.phase == "ready" and pod.node == event.node:
            node = state.nodes.get(event.node)
            if pod.policy != "static" and node is not None and _has_gpu(node, event.gpu_index):
                return None
    elif type(event) is Released:
        pod = state.pods.get(event.pod)
        if (
            pod is not None
            and pod.node == event.node
            and (
                (pod.phase == "running" and pod.gpu_index == event.gpu_index is not None)
                or (pod.phase == "ready" and event.gpu_index is None)
            )
        ):
            return None
    elif type(event) is PodRejected:
        return None
    return _problem(state, event)


def _problem(state: State, event: Event) -> str | None:
    """``admission_problem`` for an event that is neither a MessageRejected nor a replay."""
    match event:
        case PodRegistered():
            existing = state.pods.get(event.pod)
            if existing is not None:  # would reset a pod that may hold a GPU
                return f"{OUT_OF_ORDER}: {event.pod} is already registered on {existing.node}"
        case PodReady():
            pod = state.pods.get(event.pod)
            if pod is None:
                return f"{UNKNOWN_POD}: {event.pod} is not registered"
            if pod.node != event.node:
                return _wrong_node(event.pod, pod.node, event.node)
            if pod.phase != "dormant":
                return f"{OUT_OF_ORDER}: {event.pod} became ready while {pod.phase}"
        case Assigned():
            pod = state.pods.get(event.pod)
            if pod is None:
                return f"{UNKNOWN_POD}: {event.pod} is not registered"
            if pod.node != event.node:
                return f"{UNKNOWN_POD}: {event.pod} is registered on {pod.node}, not {event.node}"
            node = state.nodes.get(event.node)
            if node is None or not _has_gpu(node, event.gpu_index):
                return f"{UNKNOWN_GPU}: node {event.node} has no GPU {event.gpu_index}"
            if pod.policy == "static":
                if pod.gpu_index not in (None, event.gpu_index) or pod.phase == "running":
                    return (
                        f"{OUT_OF_ORDER}: static pod {event.pod} is {pod.phase} on GPU "
                        f"{pod.gpu_index}; assigned GPU {event.gpu_index}"
                    )
            elif pod.phase != "ready":
                return f"{OUT_OF_ORDER}: {event.pod} was assigned while {pod.phase}, not ready"
        case Preempted():
            victim = state.pods.get(event.victim)
            if victim is None:
                return f"{UNKNOWN_POD}: victim {event.victim} is not registered"
            if victim.node != event.node:
                return _wrong_node(event.victim, victim.node, event.node)
            if victim.phase != "running" or victim.gpu_index != event.gpu_index:
                return (
                    f"{OUT_OF_ORDER}: victim {event.victim} is {victim.phase}, not running on "
                    f"GPU {event.gpu_index}"
                )
            preemptor = state.pods.get(event.preemptor)
            if preemptor is None:
                return f"{UNKNOWN_POD}: preemptor {event.preemptor} is not registered"
            if preemptor.node != event.node:
                return _wrong_node(event.preemptor, preemptor.node, event.node)
        case Released():
            pod = state.pods.get(event.pod)
            if pod is None:
                return f"{UNKNOWN_POD}: {event.pod} is not registered"
            if pod.node != event.node:
                return _wrong_node(event.pod, pod.node, event.node)
            if event.gpu_index is None:
                if pod.phase != "ready":
                    return f"{OUT_OF_ORDER}: {event.pod} left the queue while {pod.phase}"
            elif pod.gpu_index != event.gpu_index:
                held = "no GPU" if pod.gpu_index is None else f"GPU {pod.gpu_index}"
                return (
                    f"{OUT_OF_ORDER}: {event.pod} released GPU {event.gpu_index} but holds {held}"
                )
            elif pod.phase != "running" and not (
                pod.policy == "static" and event.reason == "gpu-vanished"
            ):
                return (
                    f"{OUT_OF_ORDER}: {event.pod} released GPU {event.gpu_index} while {pod.phase}"
                )
        case PodRemoved():
            pod = state.pods.get(event.pod)
            if pod is not None and pod.node != event.node:
                return _wrong_node(event.pod, pod.node, event.node)
        case _:
            pass
    return None


def _wrong_node(pod: object, registered: str, named: str) -> str:
    return f"{WRONG_NODE}: {pod} is registered on {registered}, not {named}"


def _has_gpu(node: NodeState, index: int) -> bool:
    gpus = node.gpus
    if gpus:
        if index < len(gpus) and gpus[index].index == index:  # inventories list 0..n-1
            return True
        return any(gpu.index == index for gpu in gpus)
    return 0 <= index < node.gpu_count
