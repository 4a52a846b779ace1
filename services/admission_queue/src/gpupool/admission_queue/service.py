"""The admission-queue service: owns the nodes' ready queues and decides Assigned.

After every new event on a node it asks the core to serve that node's queue
(``Schedule``); the core returns the Assigned events, which are appended with
per-node optimistic concurrency. It also serves the pooling metrics, computed
on scrape from its projection.
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

from gpupool.core import Schedule
from gpupool.eventlog.port import StoredEvent
from gpupool.events import NODELESS, Envelope
from gpupool.runtime.decider import DeciderLoop, last_entry_per_node


class AdmissionQueue:
    name = "admission-queue"
    ack_before_reacting = True
    """Its reactions are decided from the folded state alone, and ``start`` decides for every
    node: a batch is acked once folded (``DeciderLoop.consume``)."""

    def __init__(self) -> None:
        self._loop: DeciderLoop | None = None

    async def start(self, loop: DeciderLoop, stack: AsyncExitStack) -> None:
        self._loop = loop
        for node in sorted(loop.projection.state.nodes):
            await self._schedule(node, None)

    async def react(self, entry: StoredEvent) -> None:
        node = entry.envelope.event.node
        if node != NODELESS:
            await self._schedule(node, entry.envelope)

    async def react_batch(self, entries: list[StoredEvent]) -> None:
        """After a batch of events: decide once for each node they touched, nodes concurrently."""
        await asyncio.gather(
            *(self._schedule(node, cause) for node, cause in last_entry_per_node(entries).items())
        )

    async def _schedule(self, node: str, cause: Envelope | None) -> None:
        assert self._loop is not None
        await self._loop.execute(Schedule(node=node), node=node, cause=cause)
