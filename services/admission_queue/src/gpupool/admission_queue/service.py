"""The admission-queue service: owns the nodes' ready queues and decides Assigned.

After every new event on a node it asks the core to serve that node's queue
(``Schedule``); the core returns the Assigned events, which are appended with
per-node optimistic concurrency. It also serves the pooling metrics, computed
on scrape from its projection.

Pipelined (the default): a batch of events pokes the nodes it touched and returns
at once, so the consumer folds the next batch while the decisions are in flight.
The poked nodes are decided together, in the poking step, their appends handed to
the log in one call and their PubAcks awaited by one task
(``DeciderLoop.execute_batch``). Each node has at most one decision in flight;
events for a node arriving meanwhile are coalesced into one more decision after it
(decided on everything folded by then). A decision is made from the folded state
alone, so deciding later, once, on more events loses nothing; one that did not land
(a conflict, after its catch-up; a failed publish) or was not decided in the batch (its
node's lock held) is decided again by a task of the node's own.
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack, suppress

from gpupool.core import Schedule
from gpupool.eventlog.port import StoredEvent
from gpupool.events import NODELESS, Envelope
from gpupool.runtime.decider import DeciderLoop, Refusal, last_entry_per_node


class AdmissionQueue:
    name = "admission-queue"
    ack_before_reacting = True
    """Its reactions are decided from the folded state alone, and ``start`` decides for every
    node: a batch is acked once folded (``DeciderLoop.consume``)."""

    def __init__(self, *, pipelined: bool = True) -> None:
        self._loop: DeciderLoop | None = None
        self.pipelined = pipelined
        """``react_batch`` returns before the decisions it started have landed."""
        self.react_on_arrival = pipelined
        """Pipelined, ``react_batch`` waits for nothing: a batch is folded and its decisions
        started within the step that received it (``DeciderLoop.consume``)."""
        self._busy: set[str] = set()
        """Nodes with a decision in flight."""
        self._deciding: dict[str, asyncio.Task[None]] = {}
        """The task deciding for the node (a batch's, or the node's own after a conflict),
        while it waits (for its PubAcks, for a lock)."""
        self._again: dict[str, Envelope | None] = {}
        """Nodes poked while their decision was in flight, with the latest cause."""

    async def start(self, loop: DeciderLoop, stack: AsyncExitStack) -> None:
        self._loop = loop
        stack.push_async_callback(self._stop_deciding)
        for node in sorted(loop.projection.state.nodes):
            await self._schedule(node, None)

    async def react(self, entry: StoredEvent) -> None:
        node = entry.envelope.event.node
        if node != NODELESS:
            await self._schedule(node, entry.envelope)

    async def react_batch(self, entries: list[StoredEvent]) -> None:
        """After a batch of events: one decision for each node they touched, made together.

        Pipelined, it returns once the decisions are made and handed to the log; otherwise
        once they landed."""
        fresh: list[tuple[str, Envelope | None]] = []
        for node, cause in last_entry_per_node(entries).items():
            if node in self._busy:
                self._again[node] = cause  # decided once more, after the one in flight
            else:
                self._busy.add(node)
                fresh.append((node, cause))
        if fresh:
            assert self._loop is not None
            self._loop.background(
                self._decide_batch(fresh), name=f"schedule {len(fresh)} node(s)", eager=True
            )
        if not self.pipelined:
            await self.settled()

    async def settled(self) -> None:
        """Wait until no decision is in flight (none poked meanwhile either)."""
        while self._deciding:
            await asyncio.gather(*set(self._deciding.values()), return_exceptions=True)

    async def _decide_batch(self, pokes: list[tuple[str, Envelope | None]]) -> None:
        """Decide for the poked nodes together (``DeciderLoop.execute_batch``), then again,
        together, for those poked while their decisions were in flight, until none was;
        a node not poked meanwhile is free once its round's decisions are in, and a node whose
        decision did not land (a conflict, a failed publish) is handed to a task of its
        own that decides it again as ``execute`` does (catching up first).

        Started eagerly (the poking step decides and hands the publishes to the
        connection); one task waits for the batch's PubAcks."""
        assert self._loop is not None
        loop = self._loop
        me = asyncio.current_task()
        assert me is not None
        owned = dict.fromkeys(node for node, _ in pokes)
        """The nodes whose decision this task has in flight (insertion-ordered)."""
        for node in owned:
            self._deciding[node] = me
        try:
            while pokes:
                missed = await loop.execute_batch(
                    [(Schedule(node=node), node, cause) for node, cause in pokes]
                )
                for index, refused in missed:
                    node, cause = pokes[index]
                    del owned[node]  # still busy: the node's own task owns it now
                    task = loop.background(
                        self._decide_while_poked(node, cause, refused),
                        name=f"schedule {node}",
                        eager=True,
                    )
                    if node in self._busy:  # not finished within this step
                        self._deciding[node] = task
                again: list[tuple[str, Envelope | None]] = []
                for node in list(owned):
                    if node in self._again:
                        again.append((node, self._again.pop(node)))
                    else:
                        del owned[node]
                        self._free(node, me)
                pokes = again
        finally:
            for node in owned:
                self._free(node, me)

    def _free(self, node: str, task: asyncio.Task[None]) -> None:
        """``node`` has no decision of ``task`` in flight any more: the next poke decides it."""
        self._busy.discard(node)
        self._again.pop(node, None)
        if self._deciding.get(node) is task:
            del self._deciding[node]

    async def _decide_while_poked(
        self, node: str, cause: Envelope | None, refused: Refusal | None
    ) -> None:
        """One node's decisions, one at a time through ``execute`` (the first one after the
        conflict that refused the batch's, where one did), until it is not poked."""
        assert self._loop is not None
        execute = self._loop.execute
        try:
            while True:
                await execute(Schedule(node=node), node=node, cause=cause, refused=refused)
                refused = None
                if node not in self._again:
                    return
                cause = self._again.pop(node)
        finally:
            self._busy.discard(node)
            self._deciding.pop(node, None)
            self._again.pop(node, None)

    async def _stop_deciding(self) -> None:
        """On stop: decisions not landed yet are decided again from the log after a restart."""
        while self._deciding:
            tasks = set(self._deciding.values())
            for task in tasks:
                task.cancel()
            for task in tasks:
                with suppress(asyncio.CancelledError):
                    await task
            for node, task in list(self._deciding.items()):
                if task.done():  # ended, its entry left behind: nothing of it is in flight
                    del self._deciding[node]

    async def _schedule(self, node: str, cause: Envelope | None) -> None:
        assert self._loop is not None
        await self._loop.execute(Schedule(node=node), node=node, cause=cause)
