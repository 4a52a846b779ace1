"""The projection every service, metric and audit command reads: the core State folded from the log.

It remembers the last stream sequence it applied (overall and per node), so that a
restart resumes, an entry seen twice (redelivery, catch-up replay) is applied once,
and a decider can append with the node's sequence as its optimistic-concurrency
expectation.

A decider folds its own node-wide appends at once, possibly before entries with lower
sequences have arrived. For other nodes' entries that is safe because the state is
partitioned by node; of its own node, a node-wide append's success proves that no unseen
entry lies before it. A writer-scoped one's proves it only of its writer, so the decider
folds such an append at once only when it is the watermark's next, else it leaves it to
be folded in log order (``DeciderLoop._fold_own``; docs/eventlog.md, "An own entry is
folded in log order"). ``last_seq`` is the watermark below which every entry was applied;
``ahead`` holds the sequences applied above it.

A node's sequence (``node_seq``, the expectation of a node-wide decision) moves only with
the watermark: to S once every entry of the node below S is folded. An entry folded ahead
of the watermark moves its writer's sequence (``writer_seq``) at once, its node's only when
the watermark passes it (``ahead_nodes`` remembers the node until then), or when it is the
decider's own node-wide append (:meth:`Projection.landed_node_wide`: its success proves
nothing of the node lay unseen below it). A writer-scoped append's success proves nothing
of the node's other writers, so a node-wide decision that expected it would land on a
state missing their entries below it (docs/eventlog.md, "Which entries an expectation
covers").

With ``statistics`` (built by :func:`metrics_projection`) it also folds the counters
the metrics expose. ``to_snapshot``/``from_snapshot`` persist and resume all of it
(see ``snapshot.py``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gpupool.core import State, assignment_holds, evolve
from gpupool.core.admission_check import EnvelopeIds, admission_problem
from gpupool.core.evolve import pod_ready, released, share_pool_assigned
from gpupool.core.producers import believed_events, producer_problem
from gpupool.core.state import GPU_PERCENT
from gpupool.events import Assigned, Envelope, Event, PodReady, PodRejected, Released
from gpupool.runtime.snapshot import (
    SNAPSHOT_FORMAT,
    Snapshot,
    state_from_record,
    state_record,
)
from gpupool.runtime.statistics import UNCOUNTED_EVENTS, LogStatistics

Observer = Callable[[State, Envelope, int], None]

MAX_PENDING_REFUSALS = 10_000

_BELIEVED: dict[str | None, frozenset[type[Event]]] = {}
"""Writer token -> the event types ``producer_problem`` believes from it (``believed_events``)."""
MAX_REMEMBERED_WRITERS = 4096


@dataclass(frozen=True, slots=True)
class Refused:
    """An envelope the projection did not apply, and why (``admission_check``)."""

    seq: int
    envelope: Envelope
    reason: str


"""Called before an envelope is folded: (state before, envelope, stream sequence)."""


@dataclass
class Projection:
    state: State = field(default_factory=State)
    last_seq: int = 0
    node_seq: dict[str, int] = field(default_factory=dict)
    undecodable: int = 0
    ahead: set[int] = field(default_factory=set)
    ahead_nodes: dict[int, str] = field(default_factory=dict)
    """The node of each entry in ``ahead`` (that names one): its ``node_seq`` moves when the
    watermark passes the entry (``_pass_ahead``)."""
    observers: list[Observer] = field(default_factory=list)
    statistics: LogStatistics | None = None
    """Counters folded from the log for the metrics (see :func:`metrics_projection`); None: not kept."""

    open_entry: tuple[int, int] | None = None
    """A decision entry folded in part: (its sequence, the index of its next envelope)."""

    envelope_ids: EnvelopeIds = field(default_factory=EnvelopeIds)
    """The last envelope ids applied: a replay of one is refused (``admission_check``)."""
    refused: deque[Refused] = field(default_factory=lambda: deque(maxlen=MAX_PENDING_REFUSALS))
    """Envelopes not applied since the owner last took them (``take_refused``): see
    ``gpupool.core.admission_check``. They still count as applied (their sequence is passed).
    A reader that never takes them keeps only the last MAX_PENDING_REFUSALS."""
    writer_seq: dict[tuple[str, str], int] = field(default_factory=dict)
    """The last sequence folded on each (node, writer token) subject: the expectation of a
    decision whose expectation is narrowed to one writer (docs/eventlog.md)."""

    def applied(self, seq: int, index: int = 0) -> bool:
        if seq <= self.last_seq or seq in self.ahead:
            return True
        return (
            self.open_entry is not None and self.open_entry[0] == seq and index < self.open_entry[1]
        )

    def apply(
        self,
        seq: int,
        envelope: Envelope,
        *,
        index: int = 0,
        last: bool = True,
        writer: str | None = None,
    ) -> bool:
        """Fold one logged envelope; False if it was already applied.

        The envelopes of a decision entry share its sequence: ``index`` and ``last``
        say which one this is (see ``StoredEvent``); the entry counts as applied once
        its last envelope is. ``writer`` is the writer token of the entry's subject.

        This is the one place a decoded entry is folded into the state.
        """
        # ``applied`` and ``_mark`` inlined: this runs for every entry of a rebuild
        if seq <= self.last_seq or seq in self.ahead:
            return False
        open_entry = self.open_entry
        if open_entry is not None and open_entry[0] == seq and index < open_entry[1]:
            return False
        state = self.state
        event = envelope.event
        problem = (
            None if writer is None else producer_problem(event, writer)
        ) or admission_problem(state, envelope, self.envelope_ids)
        # believed if its writer produces such events and it is admissible
        if problem is not None:
            self.refused.append(Refused(seq=seq, envelope=envelope, reason=problem))
        else:
            # an Assigned is checked once here for the statistics and the fold (same state)
            holds = assignment_holds(state, event) if type(event) is Assigned else None
            statistics = self.statistics
            if statistics is not None and type(event) not in UNCOUNTED_EVENTS:
                statistics.observe(state, envelope, seq, holds)
            if self.observers:
                for observer in self.observers:
                    observer(state, envelope, seq)
            evolve(state, envelope, holds)
            self.envelope_ids.add(envelope.id)
        if not last:
            self.open_entry = (seq, index + 1)
            return True
        self.open_entry = None
        if seq == self.last_seq + 1 and not self.ahead:
            self._note_write(seq, event.node, writer)  # event_node
            self.last_seq = seq  # in order: the watermark moves on
        else:
            self._mark(seq, event.node, writer)
        return True

    def apply_one(self, seq: int, envelope: Envelope, writer: str | None = None) -> bool:
        """``apply(seq, envelope, writer=writer)`` for an entry holding one envelope: the same
        fold, its most frequent cases (an in-order PodReady, Assigned, Released or PodRejected
        that is plainly admissible, no observers) checked with one look at the pod.

        Every case it does not settle at once goes to :meth:`apply`, which decides it (so a
        refusal, a replayed id, an unusual inventory, ... take the one general path); the
        state change itself is ``evolve``'s. The checks spelt out here are the admissible
        branches of ``producer_problem``, ``admission_problem`` and ``assignment_holds``, and
        the counts ``LogStatistics.observe`` makes for these types:
        ``tests/unit/test_runtime_projection_apply_one.py`` folds logs both ways and compares
        everything.

        The state changes are evolve's own folds of these events (``pod_ready``,
        ``share_pool_assigned``, ``released``), given the pod and node looked up here."""
        if seq != self.last_seq + 1 or self.ahead or self.open_entry is not None or self.observers:
            return self.apply(seq, envelope, writer=writer)
        event = envelope.event
        believed = _BELIEVED.get(writer)
        if believed is None:
            if len(_BELIEVED) >= MAX_REMEMBERED_WRITERS:
                _BELIEVED.clear()
            believed = _BELIEVED[writer] = believed_events(writer)
        ids = self.envelope_ids
        if type(event) not in believed or envelope.id in ids.members:
            return self.apply(seq, envelope, writer=writer)
        state = self.state
        statistics = self.statistics
        if type(event) is PodReady:
            pod = state.pods.get(event.pod)
            if pod is None or pod.phase != "dormant" or pod.node != event.node:
                return self.apply(seq, envelope, writer=writer)
            # PodReady: the statistics count nothing
            pod_ready(state.nodes.get(pod.node) or state.node(pod.node), pod, envelope.time)
        elif type(event) is Assigned:
            pod = state.pods.get(event.pod)
            if (
                pod is None
                or pod.phase != "ready"
                or pod.node != event.node
                or pod.policy != "share-pool"
            ):
                return self.apply(seq, envelope, writer=writer)
            node = state.nodes.get(event.node)
            index = event.gpu_index
            if node is None or index < 0:
                return self.apply(seq, envelope, writer=writer)
            gpus = node.gpus
            if gpus:
                if index >= len(gpus) or gpus[index].index != index:
                    return self.apply(seq, envelope, writer=writer)
                # admissible; it holds if the pod is not removed, the UUID is the GPU's and
                # its limits fit beside what runs there (assignment_holds)
                limits = pod.limits
                held = node.usage.get(index)
                holds = (
                    not pod.removed
                    and gpus[index].uuid == event.gpu_uuid
                    and (held.core if held is not None else 0) + limits.core <= GPU_PERCENT
                    and (held.memory if held is not None else 0) + limits.memory <= GPU_PERCENT
                )
            elif index < node.gpu_count:
                holds = False  # admissible by the advertised count; no inventory to hold on
            else:
                return self.apply(seq, envelope, writer=writer)
            if holds:
                if statistics is not None:
                    stats = statistics.nodes.get(event.node) or statistics.node(event.node)
                    stats.assignments += 1
                    if pod.ready_since is not None:  # a ready pod on this node: its wait ends
                        stats.waits.observe(envelope.time - pod.ready_since)
                share_pool_assigned(node, pod, event, envelope.time)
        elif type(event) is Released:
            pod = state.pods.get(event.pod)
            if pod is None or pod.node != event.node:
                return self.apply(seq, envelope, writer=writer)
            gpu_index = event.gpu_index
            phase = pod.phase
            if phase == "running":
                if gpu_index is None or pod.gpu_index != gpu_index:
                    return self.apply(seq, envelope, writer=writer)
            elif phase != "ready" or gpu_index is not None:
                return self.apply(seq, envelope, writer=writer)
            if statistics is not None:
                stats = statistics.nodes.get(event.node) or statistics.node(event.node)
                releases = stats.releases
                reason = event.reason
                releases[reason] = releases.get(reason, 0) + 1
                if phase == "ready" and pod.ready_since is not None:  # it gave up waiting
                    stats.waits.observe(envelope.time - pod.ready_since)
            released(state, state.nodes.get(pod.node) or state.node(pod.node), pod, event)
        elif type(event) is PodRejected:
            if statistics is not None:
                stats = statistics.nodes.get(event.node) or statistics.node(event.node)
                rejections = stats.pod_rejections
                rejected = event.reason
                rejections[rejected] = rejections.get(rejected, 0) + 1
            # PodRejected: evolve folds nothing
        else:
            return self.apply(seq, envelope, writer=writer)
        ids.add(envelope.id)
        self._note_write(seq, event.node, writer)
        self.last_seq = seq
        return True

    def _note_write(self, seq: int, node: str, writer: str | None) -> None:
        """The latest entry of ``node`` and of ``writer`` on it, as ``seq`` may move them;
        only for an entry folded in order (``seq`` the watermark's next: every one below it
        is folded), others go through ``_mark``. (Compared, not set: a decision entry above
        the watermark, folded in part, counts as applied for ``landed_node_wide`` and
        ``learn_writer_seq``, which may have moved its node's or writer's sequence to it.)"""
        node_seq = self.node_seq
        if seq > node_seq.get(node, 0):
            node_seq[node] = seq
        if writer is not None:
            key = (node, writer)
            writer_seq = self.writer_seq
            if seq > writer_seq.get(key, 0):
                writer_seq[key] = seq

    def apply_entry(
        self,
        seq: int,
        envelopes: list[Envelope] | tuple[Envelope, ...],
        *,
        writer: str | None = None,
    ) -> bool:
        """Fold every envelope of one entry (a decision this process appended)."""
        new = False
        last = len(envelopes) - 1
        for index, envelope in enumerate(envelopes):
            new = self.apply(seq, envelope, index=index, last=index == last, writer=writer) or new
        return new

    def take_refused(self) -> list[Refused]:
        """The envelopes refused since the last call (for the owner to record)."""
        refused = list(self.refused)
        self.refused.clear()
        return refused

    def skip(self, seq: int, node: str | None, writer: str | None = None) -> bool:
        """Account for an entry that could not be decoded (it still occupies its sequence).

        ``node`` is the node its subject names, if any: the entry counts as that
        node's last write for optimistic concurrency, as it does in the log.
        """
        if self.applied(seq):
            return False
        self.undecodable += 1
        self._mark(seq, node, writer)
        return True

    def _mark(self, seq: int, node: str | None, writer: str | None = None) -> None:
        """Count entry ``seq`` (of ``node``, by ``writer``) as folded: the watermark moves on if
        it is the next, else it is folded ahead, and its node's sequence waits for the
        watermark to pass it (the module's docstring)."""
        if node is not None and writer is not None:
            key = (node, writer)
            self.writer_seq[key] = max(seq, self.writer_seq.get(key, 0))
        if seq == self.last_seq + 1:
            self.last_seq = seq
            if node is not None and seq > self.node_seq.get(node, 0):
                self.node_seq[node] = seq
            ahead = self.ahead
            while ahead and self.last_seq + 1 in ahead:
                self.last_seq += 1
                ahead.discard(self.last_seq)
                self._pass_ahead(self.last_seq)
        else:
            self.ahead.add(seq)
            if node is not None:
                self.ahead_nodes[seq] = node

    def _pass_ahead(self, seq: int) -> None:
        """The watermark passed ``seq``, folded ahead of it: its node's sequence may move."""
        node = self.ahead_nodes.pop(seq, None)
        if node is not None and seq > self.node_seq.get(node, 0):
            self.node_seq[node] = seq

    def landed_node_wide(self, node: str, seq: int) -> None:
        """This process's decision on ``node``, folded, landed at ``seq`` on a node-wide
        expectation: no entry of the node lay between the one it expected and ``seq``, so
        every entry of the node up to ``seq`` is folded, even if ``seq`` is ahead of the
        watermark."""
        if self.applied(seq) and seq > self.node_seq.get(node, 0):
            self.node_seq[node] = seq

    def pass_below(self, seq: int) -> None:
        """A partitioned reader knows every sequence below ``seq`` is folded already or another
        partition's, so the watermark passes them (the projection of one node then never
        waits on the rest of the log). The caller must have that proof: an ordered replay
        handed it ``seq``, or a delivery's ``follows`` (``DeciderLoop._gap_proven``)."""
        if seq - 1 <= self.last_seq:
            return
        self.last_seq = seq - 1
        if self.ahead:
            passed = sorted(ahead for ahead in self.ahead if ahead <= self.last_seq)
            self.ahead = {ahead for ahead in self.ahead if ahead > self.last_seq}
            for ahead in passed:
                self._pass_ahead(ahead)
            while self.last_seq + 1 in self.ahead:
                self.last_seq += 1
                self.ahead.discard(self.last_seq)
                self._pass_ahead(self.last_seq)
        if self.open_entry is not None and self.open_entry[0] <= self.last_seq:
            self.open_entry = None

    def expected_node_seq(self, node: str, writer: str | None = None) -> int:
        """The sequence a decider expects to be the node's last when it appends (0: none yet);
        with ``writer``, the last of the node's entries by that writer."""
        if writer is None:
            return self.node_seq.get(node, 0)
        return self.writer_seq.get((node, writer), 0)

    def learn_writer_seq(self, node: str, writer: str, seq: int) -> bool:
        """Take ``seq`` as the last of ``node``'s entries by ``writer`` if that entry is folded.

        A conflict names the subject's actual last sequence; when it is already folded (a
        snapshot taken before ``writer_seq`` was kept), nothing is missing but the number.
        """
        if seq <= self.writer_seq.get((node, writer), 0) or not self.applied(seq):
            return False
        self.writer_seq[(node, writer)] = seq
        return True

    def to_snapshot(self) -> Snapshot:
        """Everything folded so far (observers are code, not state: they are not included)."""
        return Snapshot(
            format=SNAPSHOT_FORMAT,
            last_seq=self.last_seq,
            node_seq=dict(self.node_seq),
            undecodable=self.undecodable,
            ahead=sorted(self.ahead),
            ahead_nodes=sorted(self.ahead_nodes.items()),
            open_entry=self.open_entry,
            writer_seq=[(node, writer, seq) for (node, writer), seq in self.writer_seq.items()],
            state=state_record(self.state),
            statistics=None if self.statistics is None else self.statistics.copy(),
            applied_ids=self.envelope_ids.to_list(),
        )

    @classmethod
    def from_snapshot(cls, snapshot: Snapshot) -> Projection:
        """A projection that resumes at ``snapshot.last_seq + 1``; attach observers afterwards."""
        return cls(
            state=state_from_record(snapshot.state),
            last_seq=snapshot.last_seq,
            node_seq=dict(snapshot.node_seq),
            undecodable=snapshot.undecodable,
            ahead=set(snapshot.ahead),
            ahead_nodes=dict(snapshot.ahead_nodes),
            open_entry=snapshot.open_entry,
            writer_seq={(node, writer): seq for node, writer, seq in snapshot.writer_seq},
            statistics=None if snapshot.statistics is None else snapshot.statistics.copy(),
            envelope_ids=EnvelopeIds(snapshot.applied_ids),
        )


def metrics_projection() -> Projection:
    """A projection that also folds the counters the metrics expose (see ``statistics.py``)."""
    return Projection(statistics=LogStatistics())
