"""``decider._awaits``: what ``ReactionWaitsOnArrival`` rests on, asyncio's private record of
what a task waits for (``Task._fut_waiter``) and of a gather's children (``_children``).
A Python that renamed or dropped either would leave the check blind (a reaction waiting
for its catch-up would stall until ``CATCH_UP_WAIT_S`` again): these fail first."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from gpupool.runtime.decider import _awaits

HOW: dict[str, Callable[[asyncio.Task[Any]], Awaitable[object]]] = {
    "a task it awaits": lambda task: task,
    "a gather it awaits": lambda task: asyncio.gather(task),
}


@pytest.mark.parametrize("how", list(HOW))
async def test_a_task_is_seen_to_await_the_task_it_waits_for(how: str) -> None:
    release = asyncio.Event()
    awaiting = asyncio.Event()
    target = asyncio.create_task(release.wait(), name="target")

    async def waits() -> None:
        awaited = HOW[how](target)
        awaiting.set()  # in the step that reaches the await: suspended on it when seen
        await awaited

    waiting = asyncio.create_task(waits(), name="waiting")
    try:
        await awaiting.wait()
        assert _awaits(waiting, target)
        assert not _awaits(target, waiting)  # not the other way round
        assert _awaits(target, target)  # a task is its own
    finally:
        release.set()
        await asyncio.gather(waiting, target)
    assert not _awaits(waiting, target)  # done: waits for nothing


async def test_a_chain_of_tasks_and_gathers_is_followed() -> None:
    release = asyncio.Event()
    target = asyncio.create_task(release.wait(), name="target")
    reached = asyncio.Event()

    async def link(inner: asyncio.Task[Any], depth: int) -> None:
        awaited = asyncio.gather(inner) if depth % 2 else inner
        if depth == 1:
            reached.set()  # the outermost: every link below is suspended already
        await awaited

    chain: list[asyncio.Task[Any]] = [target]
    depth = 10  # each link a task, every other one through a gather: 16 futures in all
    for number in range(depth, 0, -1):
        chain.append(asyncio.create_task(link(chain[-1], number)))
    try:
        await reached.wait()
        assert _awaits(chain[-1], target)
        assert not _awaits(chain[1], chain[-1])
    finally:
        release.set()
        await asyncio.gather(*chain)
