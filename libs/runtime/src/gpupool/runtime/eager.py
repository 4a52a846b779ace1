"""Tasks that start at once: the caller's step runs the coroutine up to its first suspension.

``asyncio.create_task`` only schedules a coroutine: it starts on a later turn of the event
loop, after every callback already waiting there (other connections' messages, other
tasks). A decision started from a batch of deliveries (the admission-queue's, one task
per node so the consumer goes on folding) would wait that turn before it even decides;
started eagerly, it decides and hands its publish to the connection within the caller's
step, and waits for the PubAck as a task.

Python 3.12 has this built in (``asyncio.Task(..., eager_start=True)``). On 3.11 the task
is made first and entered as the running task (``asyncio.current_task()`` is the new task,
so ``asyncio.timeout`` and cancellation inside the first part belong to it); the
coroutine is driven by hand up to its first suspension; the task's own first step then
drives the rest.
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
import types
from collections.abc import Coroutine, Generator
from typing import Any, TypeVar

T = TypeVar("T")


def start_now(coro: Coroutine[Any, Any, T], *, name: str | None = None) -> asyncio.Task[T]:
    """A task of ``coro`` whose first part (up to its first suspension) has already run."""
    loop = asyncio.get_running_loop()
    if sys.version_info >= (3, 12):
        return asyncio.Task(coro, loop=loop, name=name, eager_start=True)
    first = _FirstPart(coro)
    # the task's own copy of the context, as create_task makes one: the first part runs in
    # it too, so a context variable it sets is the task's, never the caller's
    context = contextvars.copy_context()
    task = loop.create_task(first.rest(), name=name, context=context)
    caller = asyncio.current_task(loop)
    if caller is not None:
        asyncio.tasks._leave_task(loop, caller)
    asyncio.tasks._enter_task(loop, task)
    try:
        context.run(first.run)
    finally:
        asyncio.tasks._leave_task(loop, task)
        if caller is not None:
            asyncio.tasks._enter_task(loop, caller)
    # cancelled before its first step the task never runs ``rest``: the coroutine is closed
    # then (its ``finally`` blocks run, but not an ``except CancelledError``, and an await
    # there cannot be run: 3.12's eager start throws the cancellation in instead); once it
    # finished, closing does nothing
    task.add_done_callback(lambda _: coro.close())
    return task


class _FirstPart:
    """A coroutine run by hand up to its first suspension, and what that gave."""

    def __init__(self, coro: Coroutine[Any, Any, Any]) -> None:
        self.coro = coro
        self.yielded: Any = None
        self.outcome: tuple[bool, Any] | None = None
        """(finished, its value) or (raised, the error): it ended within the first part."""

    def run(self) -> None:
        try:
            self.yielded = self.coro.send(None)
        except StopIteration as stop:
            self.outcome = (True, stop.value)
        except BaseException as error:  # the task's outcome, whatever it is
            self.outcome = (False, error)

    async def rest(self) -> Any:
        if self.outcome is not None:
            finished, value = self.outcome
            if finished:
                return value
            raise value
        return await _drive(self.coro, self.yielded)


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
