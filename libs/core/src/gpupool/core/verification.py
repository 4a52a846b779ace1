"""Liveness and optimality of a log, checked by folding it (pure: used by ``gpupool verify``).

Safety (no GPU over 100 %, queue order, ...) is checked entry by entry elsewhere.
This module checks what a log can get wrong by *not* doing something, or by doing
more than needed. Each finding names the first log entry that breaks the rule:

* **idle beside a fitting head**: on a share-pool node, the head of the ready
  queue fits on a GPU of the inventory and is not assigned. That may last one
  decision (the admission-queue reacts to the entry that made room), not longer:
  it is a finding when a scheduling decision for the node (an entry that assigns
  there) leaves it so, or when the log ends so. The finding names the entry after
  which the head first fitted. A decision caused by an entry *before* the one that
  made room (its envelope's ``causation_id``) may not have seen it: an Assigned's
  expectation covers only other claims, so a Released appended meanwhile does not
  refuse it (docs/eventlog.md). Such a decision does not end the head's one
  decision; the next one, or the end of the log, judges it. So is a decision that
  names no cause (or one older than the window): a service's first decisions after
  it starts react to no entry, and may have been made from a rebuild that ended
  before the room was made (a restart racing a release).
  A decision whose own entry makes the head fit (it assigned the pods before it, and
  the next one fits too) is the one decision only if it reacted to the node's last
  entry before it other than an assignment (or a later one): a ``PodReady`` (or a
  ``Released``) appended while the decision was in flight is not refused by the
  Assigned's expectation either, and the pod it readied (or the room it made) may be
  the head the decision leaves fitting. Without a cause, or with an older one, the
  next decision, or the end of the log, judges it.
* **minimal victim set**: a preemption's victims (the Preempted events of one
  decision; in logs written before decisions were single entries, consecutive
  Preempted entries for the same preemptor) are no more than the smallest set the
  specification's rule (``plan_preemption``) finds on the state before it, and they
  free enough for the preemptor to fit.
* **every Releasing ends in Released**: a pod deleted while it held a slot is
  released before the log ends.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from gpupool.core.evolve import evolve
from gpupool.core.placement import choose_gpu, fits, gpu_usage, ready_queue, subtract
from gpupool.core.preemption import plan_preemption
from gpupool.core.state import PodState, State
from gpupool.events import Assigned, Envelope, PodRef, PodRemoved, Preempted, event_tag

CAUSE_WINDOW = 65_536
"""How many recent envelope ids verify keeps to find a decision's cause (bounded memory)."""

RULES = (
    "no idle room beside a waiting head that fits for longer than one decision",
    "each preemption's victim set is the smallest the rule allows, and frees enough",
    "every pod deleted while holding a GPU is released",
)
"""The rules this module checks, in the words ``verify`` prints."""


@dataclass(frozen=True, slots=True)
class Finding:
    seq: int
    envelope_id: str
    type: str
    pod: str
    message: str


@dataclass(slots=True)
class _Stall:
    seq: int
    envelope: Envelope
    head: PodRef
    gpu: int
    decided_at: int | None = None
    """An entry that assigned on the node and left the head fitting: unless the next entry
    on the node assigns too (old logs split a decision over entries), the decision is over."""


@dataclass(slots=True)
class _Preemption:
    seq: int
    envelope: Envelope
    preemptor: PodRef
    gpu: int
    victims: list[PodRef]
    before: State


@dataclass
class LivenessChecker:
    """Feed it every log entry in order (``entry``), then ``finish``; read ``findings``."""

    state: State = field(default_factory=State)
    findings: list[Finding] = field(default_factory=list)
    _stalls: dict[str, _Stall] = field(default_factory=dict)
    _preemptions: dict[str, _Preemption] = field(default_factory=dict)
    _removed: dict[PodRef, tuple[int, Envelope]] = field(default_factory=dict)
    _last_change: dict[str, int] = field(default_factory=dict)
    """The node's last entry holding an event other than ``Assigned`` (what may ready a pod
    or make room): a decision that makes its head fit by its own entry knew of that head
    only if it reacted to this entry or a later one."""
    _seq_of_id: OrderedDict[str, int] = field(default_factory=OrderedDict)
    """The sequence of the last CAUSE_WINDOW envelopes folded, by id: where a decision's
    cause lies (a cause older than that is not found: the decision is judged by the next)."""

    def entry(self, seq: int, envelopes: Sequence[Envelope]) -> None:
        """Fold one log entry (the envelopes of one decision, sharing ``seq``)."""
        if not envelopes:
            return
        nodes = {envelope.event.node for envelope in envelopes}
        preempted = [e for e in envelopes if isinstance(e.event, Preempted)]
        for node in nodes:
            self._close_preemption_unless_continued(node, preempted)
        assigns = {e.event.node for e in envelopes if isinstance(e.event, Assigned)}
        for node in nodes:
            stall = self._stalls.get(node)
            if stall is not None and stall.decided_at is not None and node not in assigns:
                self._decision_left_room(node, stall)
        before = self.state.copy() if preempted else None
        for envelope in envelopes:
            evolve(self.state, envelope)
            self._note_removal(seq, envelope)
            self._seq_of_id.setdefault(envelope.id, seq)
            if len(self._seq_of_id) > CAUSE_WINDOW:
                self._seq_of_id.popitem(last=False)
        if before is not None:
            self._open_or_extend_preemption(seq, preempted, before)
        cause = self._cause(envelopes)
        for node in nodes:
            self._check_stall(seq, envelopes[0], node, decided=node in assigns, cause=cause)
        for envelope in envelopes:
            if not isinstance(envelope.event, Assigned):
                self._last_change[envelope.event.node] = seq

    def finish(self) -> list[Finding]:
        for node in list(self._preemptions):
            self._close_preemption(node)
        for node, stall in sorted(self._stalls.items()):
            if stall.decided_at is not None:
                self._decision_left_room(node, stall)
                continue
            self._find(
                stall.seq,
                stall.envelope,
                str(stall.head),
                f"{stall.head} waits at the head on {node} while GPU {stall.gpu} has room for "
                "it, until the end of the log",
            )
        self._stalls.clear()
        for pod, (seq, envelope) in sorted(self._removed.items()):
            if pod in self.state.pods and self.state.pods[pod].removed:
                self._find(
                    seq,
                    envelope,
                    str(pod),
                    f"{pod} was deleted while holding a GPU and never released",
                )
        self.findings.sort(key=lambda finding: finding.seq)
        return self.findings

    # ------------------------------------------------------------------ rules

    def _find(self, seq: int, envelope: Envelope, pod: str, message: str) -> None:
        self.findings.append(
            Finding(
                seq=seq,
                envelope_id=envelope.id,
                type=event_tag(envelope.event),
                pod=pod,
                message=message,
            )
        )

    def _fitting_head(self, node_name: str) -> tuple[PodState, int] | None:
        node = self.state.nodes.get(node_name)
        if node is None or node.policy != "share-pool" or not node.gpus:
            return None
        queue = ready_queue(self.state, node_name)
        if not queue:
            return None
        present = {gpu.index for gpu in node.gpus}
        usage = {
            index: used
            for index, used in gpu_usage(node, self.state.pods_on(node_name)).items()
            if index in present
        }
        gpu = choose_gpu(usage, queue[0].limits)
        return None if gpu is None else (queue[0], gpu)

    def _cause(self, envelopes: Sequence[Envelope]) -> int | None:
        """The sequence of the entry a decision reacted to, if it names one this log holds."""
        for envelope in envelopes:
            if isinstance(envelope.event, Assigned) and envelope.causation_id:
                return self._seq_of_id.get(envelope.causation_id)
        return None

    def _check_stall(
        self, seq: int, envelope: Envelope, node: str, *, decided: bool, cause: int | None = None
    ) -> None:
        fitting = self._fitting_head(node)
        open_stall = self._stalls.get(node)
        if fitting is None:
            self._stalls.pop(node, None)
            return
        head, gpu = fitting
        if open_stall is None or open_stall.head != head.ref:
            open_stall = self._stalls[node] = _Stall(
                seq=seq, envelope=envelope, head=head.ref, gpu=gpu
            )
        open_stall.gpu = gpu
        if not decided or cause is None:
            return
        # the entry the decision must have seen to know of the room: the one after which
        # the head first fitted, or, where its own entry makes the head fit, the node's
        # last entry before it that could have readied that head or made room for it
        known_from = self._last_change.get(node, 0) if open_stall.seq == seq else open_stall.seq
        if cause >= known_from:
            open_stall.decided_at = seq  # it knew of the room: its decision was the one

    def _decision_left_room(self, node: str, stall: _Stall) -> None:
        self._find(
            stall.seq,
            stall.envelope,
            str(stall.head),
            f"a scheduling decision on {node} (entry {stall.decided_at}) left the head "
            f"{stall.head} waiting although GPU {stall.gpu} has room for it",
        )
        del self._stalls[node]

    def _note_removal(self, seq: int, envelope: Envelope) -> None:
        event = envelope.event
        if isinstance(event, PodRemoved):
            pod = self.state.pods.get(event.pod)
            if pod is not None and pod.removed:
                self._removed[event.pod] = (seq, envelope)
        else:
            for ref in list(self._removed):
                if ref not in self.state.pods:
                    del self._removed[ref]

    def _close_preemption_unless_continued(self, node: str, preempted: list[Envelope]) -> None:
        group = self._preemptions.get(node)
        if group is None:
            return
        continues = bool(preempted) and all(
            isinstance(e.event, Preempted)
            and e.event.node == node
            and e.event.preemptor == group.preemptor
            and e.event.gpu_index == group.gpu
            for e in preempted
        )
        if not continues:
            self._close_preemption(node)

    def _open_or_extend_preemption(
        self, seq: int, preempted: list[Envelope], before: State
    ) -> None:
        for envelope in preempted:
            event = envelope.event
            assert isinstance(event, Preempted)
            group = self._preemptions.get(event.node)
            if group is None:
                group = self._preemptions[event.node] = _Preemption(
                    seq=seq,
                    envelope=envelope,
                    preemptor=event.preemptor,
                    gpu=event.gpu_index,
                    victims=[],
                    before=before,
                )
            group.victims.append(event.victim)

    def _close_preemption(self, node_name: str) -> None:
        group = self._preemptions.pop(node_name)
        before = group.before
        node = before.nodes.get(node_name)
        head = before.pods.get(group.preemptor)
        if node is None or head is None:
            return
        pods = before.pods_on(node_name)
        usage = gpu_usage(node, pods)
        freed = usage.get(group.gpu)
        if freed is not None:
            for victim in group.victims:
                held = before.pods.get(victim)
                if held is not None:
                    freed = subtract(freed, held.limits)
            if not fits(freed, head.limits):
                self._find(
                    group.seq,
                    group.envelope,
                    str(group.preemptor),
                    f"preempting {', '.join(map(str, group.victims))} does not free enough on "
                    f"GPU {group.gpu} of {node_name} for {group.preemptor}",
                )
                return
        present = {gpu.index for gpu in node.gpus}
        plan = plan_preemption(
            before,
            node_name,
            {index: used for index, used in usage.items() if index in present},
            group.envelope.time,
        )
        if plan is not None and len(group.victims) > len(plan.victims):
            smallest = ", ".join(str(victim.pod.ref) for victim in plan.victims)
            self._find(
                group.seq,
                group.envelope,
                str(group.preemptor),
                f"{len(group.victims)} victims ({', '.join(map(str, group.victims))}) preempted "
                f"for {group.preemptor} where {len(plan.victims)} suffice ({smallest})",
            )


def check_liveness_and_optimality(
    entries: Iterable[tuple[int, Sequence[Envelope]]],
) -> list[Finding]:
    """Every finding of a whole log, given as (sequence, envelopes of that entry) in order."""
    checker = LivenessChecker()
    for seq, envelopes in entries:
        checker.entry(seq, envelopes)
    return checker.finish()
