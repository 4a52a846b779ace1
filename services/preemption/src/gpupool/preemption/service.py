"""The preemption service: owns Preempted.

After every new event on a node it asks the core for a preemption plan
(``PlanPreemption``: planned on a snapshot, only the chosen plan is emitted).
Fairness preemption needs a clock: the core names the next moment a running pod
crosses ``podMaxDurationMinutes`` while others wait (``next_preemption_check``),
and a timer here wakes the service then. An event wakes the timer only on a node whose
deadline may change (``PreemptionDeadlines.may_change``): without fairness preemption
configured, a node's events cost the timer nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from contextlib import AsyncExitStack, suppress

from gpupool.core import PlanPreemption, PreemptionDeadlines
from gpupool.eventlog.port import StoredEvent
from gpupool.events import NODELESS, Envelope
from gpupool.runtime.decider import DeciderLoop, last_entry_per_node

log = logging.getLogger(__name__)


class PreemptionService:
    name = "preemption"

    def __init__(self) -> None:
        self._loop: DeciderLoop | None = None
        self._changed = asyncio.Event()
        self._deadlines = PreemptionDeadlines()
        self._touched: set[str] = set()
        """Nodes whose deadline the timer recomputes at its next pass (all of them at start)."""

    async def start(self, loop: DeciderLoop, stack: AsyncExitStack) -> None:
        self._loop = loop
        for node in sorted(loop.projection.state.nodes):
            await self._plan(node, None)
        self._touched.update(loop.projection.state.nodes)
        timer = loop.background(self._timer(), name="preemption-timer")

        async def stop_timer() -> None:
            timer.cancel()
            with suppress(asyncio.CancelledError):
                await timer

        stack.push_async_callback(stop_timer)

    async def react(self, entry: StoredEvent) -> None:
        node = entry.envelope.event.node
        if node != NODELESS:
            await self._plan(node, entry.envelope)
            self._note_touched([node])

    async def react_batch(self, entries: list[StoredEvent]) -> None:
        """After a batch of events: plan once for each node they touched, nodes concurrently."""
        touched = last_entry_per_node(entries)
        if len(touched) == 1:  # one node: planned in this task (gather would make it one)
            ((node, cause),) = touched.items()
            await self._plan(node, cause)
        else:
            await asyncio.gather(*(self._plan(node, cause) for node, cause in touched.items()))
        self._note_touched(touched)

    def _note_touched(self, nodes: Iterable[str]) -> None:
        """The timer recomputes these nodes' deadlines at its next pass; it is woken only for
        nodes whose deadline may change (a node without fairness preemption has none)."""
        assert self._loop is not None
        state = self._loop.projection.state
        timed = [node for node in nodes if self._deadlines.may_change(state, node)]
        if timed:
            self._touched.update(timed)
            self._changed.set()

    async def _plan(self, node: str, cause: Envelope | None) -> None:
        assert self._loop is not None
        events = await self._loop.execute(PlanPreemption(node=node), node=node, cause=cause)
        for event in events:
            log.info("preemption: %s", event)

    async def _timer(self) -> None:
        """Sleep until the earliest podMaxDurationMinutes crossing on any node, or a change.

        After a change only the nodes touched since the last pass get their deadline
        computed again (a heap keeps the rest): a pass costs what changed, not the node count.
        """
        assert self._loop is not None
        loop = self._loop
        while True:
            now = loop.clock()
            self._changed.clear()  # before taking the touched nodes: a later change wakes us
            touched, self._touched = self._touched, set()
            for node in touched:
                self._deadlines.update(loop.projection.state, node, now)
            earliest = self._deadlines.earliest()
            if earliest is None:
                await self._changed.wait()
                continue
            when, node = earliest
            delay = max(0.0, (when - now).total_seconds())
            try:
                async with asyncio.timeout(delay):  # not wait_for: it can lose a cancellation
                    await self._changed.wait()
                continue  # something changed: recompute the touched nodes' deadlines
            except TimeoutError:
                pass
            self._deadlines.passed(node)
            self._touched.add(node)
            await self._plan(node, None)
