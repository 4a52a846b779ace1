"""The admission-queue service: owns the nodes' ready queues and decides Assigned.

After every new event on a node it asks the core to serve that node's queue
(``Schedule``); the core returns the Assigned events, which are appended with
per-node optimistic concurrency. It also serves the pooling metrics, computed
on scrape from its projection.

Pipelined (the default): a batch of events pokes the nodes it touched and returns
at once, so the consumer folds the next batch while the decisions are in flight.
Each node has at most one decision in flight; events for a node arriving meanwhile
are coalesced into one more decision after it (decided on everything folded by
then). A decision is made from the folded state alone, so deciding later, once, on
more events loses nothing.
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack, suppress

from gpupool.core import Schedule
from gpupool.eventlog.port import StoredEvent
from gpupool.events import NODELESS, Envelope
from gpupool.runtime.decider import DeciderLoop, last_entry_per_node


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
        """The node's decision task, while it waits (for its PubAck, for a lock)."""
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
        """After a batch of events: one decision for each node they touched, nodes concurrently.

        Pipelined, it returns once the decisions are started; otherwise once they landed."""
        for node, cause in last_entry_per_node(entries).items():
            self._poke(node, cause)
        if not self.pipelined:
            await self.settled()

    async def settled(self) -> None:
        """Wait until no decision is in flight (none poked meanwhile either)."""
        while self._deciding:
            await asyncio.gather(*self._deciding.values(), return_exceptions=True)

    def _poke(self, node: str, cause: Envelope) -> None:
        """Decide for ``node`` now, or once more after the decision in flight.

        The decision starts at once (eagerly): it decides and hands its publish to the
        connection before this returns, and waits for its PubAck as a task (a task only
        scheduled would wait for a turn of the event loop before it decided)."""
        if node in self._busy:
            self._again[node] = cause  # decided once more, after the one in flight
            return
        assert self._loop is not None
        self._busy.add(node)
        task = self._loop.background(
            self._decide_while_poked(node, cause), name=f"schedule {node}", eager=True
        )
        if node in self._busy:  # not finished within this step (it waits for its PubAck)
            self._deciding[node] = task

    async def _decide_while_poked(self, node: str, cause: Envelope | None) -> None:
        assert self._loop is not None
        execute = self._loop.execute
        try:
            while True:
                await execute(Schedule(node=node), node=node, cause=cause)  # _schedule, inline
                if node not in self._again:
                    return
                cause = self._again.pop(node)
        finally:
            self._busy.discard(node)
            self._deciding.pop(node, None)
            self._again.pop(node, None)

    async def _stop_deciding(self) -> None:
        """On stop: decisions not landed yet are decided again from the log after a restart."""
        for task in list(self._deciding.values()):
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task

    async def _schedule(self, node: str, cause: Envelope | None) -> None:
        assert self._loop is not None
        await self._loop.execute(Schedule(node=node), node=node, cause=cause)
