"""A failing background task stops the service with its error instead of leaving it looking
healthy without the task (the preemption timer, the memory guard, the Kubernetes watches)."""

from __future__ import annotations

import asyncio

import pytest

from gpupool.eventlog import InMemoryEventLog
from gpupool.runtime.decider import DeciderLoop


async def test_a_failing_background_task_is_recorded_and_signalled() -> None:
    loop = DeciderLoop(InMemoryEventLog(), service="test")

    async def broken() -> None:
        raise OSError("the sampler went away")

    task = loop.background(broken(), name="broken")
    async with asyncio.timeout(5):
        await loop.failed.wait()
    await task  # the task itself ends quietly; the failure is the loop's to report
    assert isinstance(loop.failure, OSError)


async def test_a_cancelled_background_task_is_not_a_failure() -> None:
    loop = DeciderLoop(InMemoryEventLog(), service="test")
    task = loop.background(asyncio.Event().wait(), name="forever")
    await asyncio.sleep(0)  # let it start
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not loop.failed.is_set()


async def test_an_eager_background_task_that_fails_at_once_is_recorded_within_the_call() -> None:
    loop = DeciderLoop(InMemoryEventLog(), service="test")

    async def broken() -> None:
        raise OSError("the connection is gone")

    task = loop.background(broken(), name="broken", eager=True)

    assert loop.failed.is_set()  # it ran within background(): no turn of the loop needed
    await task
    assert isinstance(loop.failure, OSError)
