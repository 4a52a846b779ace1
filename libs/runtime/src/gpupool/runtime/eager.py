"""Tasks that start at once: the caller's step runs the coroutine up to its first suspension.

``asyncio.create_task`` only schedules a coroutine: it starts on a later turn of the event
loop, after every callback already waiting there (other connections' messages, other
tasks). A decision started from a batch of deliveries (the admission-queue's, one task
per node so the consumer goes on folding) would wait that turn before it even decides;
started eagerly, it decides and hands its publish to the connection within the caller's
step, and becomes a task only when it waits for the PubAck.

Python 3.12 has this built in (``asyncio.Task(..., eager_start=True)``); on 3.11 the
coroutine is driven by hand up to its first suspension, and a task drives the rest. The
difference that remains on 3.11: while the first part runs, ``asyncio.current_task()``
is the caller's task (nothing on the services' paths asks before it first waits:
``asyncio.Lock`` and 3.11's ``asyncio.wait_for`` do not).
"""

from __future__ import annotations

import asyncio
import sys
import types
from collections.abc import Coroutine, Generator
from typing import Any, TypeVar

T = TypeVar("T")


def start_now(coro: Coroutine[Any, Any, T], *, name: str | None = None) -> asyncio.Task[T]:
    """A task of ``coro`` whose first part (up to its first suspension) has already run."""
    if sys.version_info >= (3, 12):
        return asyncio.Task(coro, loop=asyncio.get_running_loop(), name=name, eager_start=True)
    try:
        yielded = coro.send(None)
    except StopIteration as stop:
        return asyncio.create_task(_finished(stop.value), name=name)
    except BaseException as error:  # the task's outcome, whatever it is
        return asyncio.create_task(_failed(error), name=name)
    task = asyncio.create_task(_rest(coro, yielded), name=name)
    # cancelled before its first step the task never runs ``_rest``: the coroutine is
    # closed then (its ``finally`` blocks run); once it finished, closing does nothing
    task.add_done_callback(lambda _: coro.close())
    return task


async def _finished(value: T) -> T:
    return value


async def _failed(error: BaseException) -> Any:
    raise error


async def _rest(coro: Coroutine[Any, Any, T], yielded: Any) -> T:
    return await _drive(coro, yielded)


@types.coroutine
def _drive(coro: Coroutine[Any, Any, T], yielded: Any) -> Generator[Any, Any, T]:
    """What ``await coro`` would do from the suspension ``yielded`` on."""
    while True:
        try:
            sent = yield yielded
        except BaseException as error:  # thrown into the coroutine
            try:
                yielded = coro.throw(error)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
        else:
            try:
                yielded = coro.send(sent)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
