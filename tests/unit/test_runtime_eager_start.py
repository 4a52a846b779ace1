"""A task started now (``start_now``) has run up to its first suspension when it is returned,
and from there on behaves as any task: its result, its error, its cancellation."""

from __future__ import annotations

import asyncio
import contextvars

import pytest

from gpupool.runtime.eager import start_now


async def test_a_task_started_now_has_run_up_to_its_first_wait_before_it_is_returned() -> None:
    steps: list[str] = []
    gate: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def work() -> str:
        steps.append("before the wait")
        value = await gate
        steps.append("after the wait")
        return value * 2

    task = start_now(work(), name="work")

    assert steps == ["before the wait"]  # nothing yielded to the loop in between
    assert not task.done()
    gate.set_result("ab")
    assert await task == "abab"
    assert steps == ["before the wait", "after the wait"]
    assert task.get_name() == "work"


async def test_a_coroutine_that_never_waits_is_finished_with_its_result() -> None:
    steps: list[str] = []

    async def quick() -> int:
        steps.append("ran")
        return 7

    task = start_now(quick())

    assert steps == ["ran"]
    assert await task == 7


async def test_an_error_before_the_first_wait_is_the_tasks_error() -> None:
    async def broken() -> None:
        raise OSError("no connection")

    task = start_now(broken())

    with pytest.raises(OSError, match="no connection"):
        await task


async def test_an_error_after_a_wait_is_the_tasks_error() -> None:
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def broken_later() -> None:
        await gate
        raise ValueError("bad state")

    task = start_now(broken_later())
    gate.set_result(None)

    with pytest.raises(ValueError, match="bad state"):
        await task


async def test_a_value_thrown_into_the_wait_reaches_the_coroutine() -> None:
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def handles_it() -> str:
        try:
            await gate
        except LookupError as error:
            return f"handled {error}"
        return "not reached"

    task = start_now(handles_it())
    gate.set_exception(LookupError("gone"))

    assert await task == "handled gone"


async def test_cancelling_the_task_cancels_the_coroutine_where_it_waits() -> None:
    cleaned: list[str] = []
    started = asyncio.Event()

    async def waits_forever() -> None:
        try:
            started.set()
            await asyncio.Event().wait()
        finally:
            cleaned.append("finally")

    task = start_now(waits_forever())
    assert started.is_set()
    await asyncio.sleep(0)  # the task has taken over the wait
    task.cancel()

    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned == ["finally"]


async def test_cancelled_before_its_first_step_the_coroutine_gets_the_cancellation_where_it_waits() -> (
    None
):
    """As for any task waiting there: its ``except CancelledError`` runs and may await, and
    the future it waited for is cancelled (not the coroutine closed under it)."""
    seen: list[str] = []
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def waits_for_the_gate() -> None:
        try:
            await gate
        except asyncio.CancelledError:
            seen.append("cancelled")
            await asyncio.sleep(0)  # a closed coroutine could not await here
            seen.append("cleaned up")
            raise
        finally:
            seen.append("finally")

    task = start_now(waits_for_the_gate())
    task.cancel()  # before the loop ran the task at all

    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == ["cancelled", "cleaned up", "finally"]
    assert task.cancelled()
    assert gate.cancelled()


async def test_cancelled_before_its_first_step_a_coroutine_that_handles_it_returns_its_value() -> (
    None
):
    async def stops_cleanly() -> str:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            return "stopped"
        return "not reached"

    task = start_now(stops_cleanly())
    task.cancel()

    assert await task == "stopped"


async def test_a_coroutine_that_ended_in_its_first_part_keeps_its_result_when_cancelled() -> None:
    async def quick() -> int:
        return 7

    task = start_now(quick())

    assert task.cancel() is False  # it had already finished: its result stands
    assert await task == 7


async def test_a_coroutine_that_failed_in_its_first_part_keeps_its_error_when_cancelled() -> None:
    async def broken() -> None:
        raise OSError("no connection")

    task = start_now(broken())

    assert task.cancel() is False
    with pytest.raises(OSError, match="no connection"):
        await task


async def test_a_task_waiting_after_its_first_part_is_cancelled_as_any_task() -> None:
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def waits() -> None:
        await gate

    task = start_now(waits())

    assert task.cancel() is True
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gate.cancelled()


async def test_the_first_part_runs_as_the_new_task_not_as_the_caller() -> None:
    seen: list[asyncio.Task[object] | None] = []
    caller = asyncio.current_task()

    async def work() -> str:
        seen.append(asyncio.current_task())
        # a timeout entered in the first part belongs to this task: when it expires, this
        # task is cancelled (and gets TimeoutError), never the caller
        async with asyncio.timeout(0):
            await asyncio.Event().wait()
        return "not reached"

    task = start_now(work())

    assert seen == [task]
    assert asyncio.current_task() is caller  # the caller is the running task again
    with pytest.raises(TimeoutError):
        await task
    assert caller is not None and not caller.cancelling()


async def test_a_context_variable_set_in_the_first_part_is_the_tasks_not_the_callers() -> None:
    where: contextvars.ContextVar[str] = contextvars.ContextVar("where", default="unset")
    seen: list[str] = []
    resume = asyncio.Event()

    async def work() -> None:
        where.set("inner")
        await resume.wait()
        seen.append(where.get())

    task = start_now(work())
    assert where.get() == "unset"  # the caller's context is untouched
    resume.set()
    await task
    assert seen == ["inner"]  # and the task kept its own after the wait


async def test_a_waiting_eager_task_names_its_coroutine_and_shows_its_stack() -> None:
    event = asyncio.Event()

    async def waiting_for_the_event() -> None:
        await event.wait()

    task = start_now(waiting_for_the_event(), name="eager")  # waiting at once
    shown, stack = repr(task), task.get_stack()
    event.set()
    await task
    assert "waiting_for_the_event" in shown, shown
    assert [frame.f_code.co_name for frame in stack] == ["waiting_for_the_event"]
