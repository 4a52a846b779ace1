"""Tasks that start at once: the caller's step runs the coroutine up to its first suspension.

``asyncio.create_task`` only schedules a coroutine: it starts on a later turn of the event
loop, after every callback already waiting there (other connections' messages, other
tasks). A decision started from a batch of deliveries (the admission-queue's, one task
per batch so the consumer goes on folding) would wait that turn before it even decides;
started eagerly, it decides and hands its publish to the connection within the caller's
step, and waits for the PubAck as a task.

Python 3.12 has this built in (``asyncio.Task(..., eager_start=True)``). On 3.11 the task
is made first and entered as the running task (``asyncio.current_task()`` is the new task,
so ``asyncio.timeout`` and cancellation inside the first part belong to it); the
coroutine is driven by hand up to its first suspension; the task drives it on from
there (:class:`_TakenUp`): its first step hands the task what the first part waits for,
or, when the task was cancelled before that step, throws the CancelledError into the
coroutine where it waits (cancelling the future it waits for), as for any task waiting
there. A coroutine that ended within its first part keeps its outcome, as with 3.12's
eager start (there the task is done at once and a cancel does nothing): its task's
``cancel()`` does nothing and answers False (:class:`_EagerTask`), though ``done()`` turns
True only at the task's first step, on the next turn of the loop.
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
from collections.abc import Coroutine, Generator
from typing import Any, TypeVar

T = TypeVar("T")


def start_now(coro: Coroutine[Any, Any, T], *, name: str | None = None) -> asyncio.Task[T]:
    """A task of ``coro`` whose first part (up to its first suspension) has already run."""
    loop = asyncio.get_running_loop()
    if sys.version_info >= (3, 12):
        return asyncio.Task(coro, loop=loop, name=name, eager_start=True)
    taken_up = _TakenUp(coro)
    # the task's own copy of the context, as create_task makes one: the first part runs in
    # it too, so a context variable it sets is the task's, never the caller's
    context = contextvars.copy_context()
    task = _EagerTask(taken_up, loop=loop, name=name, context=context)
    task._taken_up = taken_up
    caller = asyncio.current_task(loop)
    if caller is not None:
        asyncio.tasks._leave_task(loop, caller)
    asyncio.tasks._enter_task(loop, task)
    try:
        context.run(taken_up.run_first_part)
    finally:
        asyncio.tasks._leave_task(loop, task)
        if caller is not None:
            asyncio.tasks._enter_task(loop, caller)
    return task


class _EagerTask(asyncio.Task[T]):
    """The 3.11 task of a coroutine taken up: cancelling it once the coroutine ended within
    its first part does nothing and answers False, as cancelling a finished task does."""

    _taken_up: _TakenUp[T]  # set by start_now (no __init__ of its own on the hot path)

    def cancel(self, msg: Any | None = None) -> bool:
        if self._taken_up.ended_in_first_part:
            return False
        return super().cancel(msg)


class _TakenUp(Coroutine[Any, Any, T]):
    """A coroutine run by hand up to its first suspension, then by its task from there, as
    if the task had run it all along."""

    def __init__(self, coro: Coroutine[Any, Any, T]) -> None:
        self._coro = coro
        # the coroutine's own names, so that the task's repr and a report of a task
        # destroyed while pending name the coroutine, not this wrapper
        self.__name__ = getattr(coro, "__name__", type(coro).__name__)
        self.__qualname__ = getattr(coro, "__qualname__", self.__name__)
        self._first_step = True
        """The task has not stepped yet: the first part's suspension is still to hand on."""
        self._yielded: Any = None
        self._outcome: tuple[bool, Any] | None = None
        """(finished, its value) or (raised, the error): it ended within the first part."""
        self._ended_early = False

    def run_first_part(self) -> None:
        try:
            self._yielded = self._coro.send(None)
        except StopIteration as stop:
            self._outcome = (True, stop.value)
            self._ended_early = True
        except BaseException as error:  # the task's outcome, whatever it is
            self._outcome = (False, error)
            self._ended_early = True

    @property
    def ended_in_first_part(self) -> bool:
        """The coroutine ended (returned or raised) within the first part."""
        return self._ended_early

    def _ended(self) -> Any:
        """The first part's outcome, as the task's first step."""
        assert self._outcome is not None
        finished, value = self._outcome
        self._outcome = None  # no reference cycle through the error's traceback
        if finished:
            raise StopIteration(value)
        raise value

    def send(self, value: Any) -> Any:
        if self._first_step:  # the task's first step: what the first part waits for
            self._first_step = False
            if self._outcome is not None:
                return self._ended()
            yielded, self._yielded = self._yielded, None
            return yielded
        return self._coro.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        if self._first_step:  # cancelled before the task's first step
            self._first_step = False
            if self._outcome is not None:
                return self._ended()
            waited, self._yielded = self._yielded, None
            if isinstance(typ, asyncio.CancelledError) and asyncio.isfuture(waited):
                # a task cancelled while it waits for a future cancels that future
                waited._asyncio_future_blocking = False
                waited.cancel()
        if val is None and tb is None:
            return self._coro.throw(typ)
        return self._coro.throw(typ, val, tb)  # pragma: no cover - asyncio throws instances

    def close(self) -> None:
        self._coro.close()

    @property
    def cr_frame(self) -> Any:
        """The coroutine's frame (``Task.get_stack``, the task's repr)."""
        return getattr(self._coro, "cr_frame", None)

    @property
    def cr_code(self) -> Any:
        return getattr(self._coro, "cr_code", None)

    @property
    def cr_running(self) -> bool:
        return bool(getattr(self._coro, "cr_running", False))

    @property
    def cr_await(self) -> Any:
        return getattr(self._coro, "cr_await", None)

    def __await__(self) -> Generator[Any, None, T]:  # pragma: no cover - only a task drives it
        raise TypeError("a coroutine taken up by its task is awaited through the task")
