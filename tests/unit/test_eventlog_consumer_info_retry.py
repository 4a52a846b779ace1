"""A subscriber's consumer_info is retried on a NATS timeout (issue 12: one timeout there
ended the node-executor, and with it the node's running jobs)."""

from __future__ import annotations

from typing import Any

import nats.errors
import pytest

from gpupool.eventlog import jetstream
from gpupool.eventlog.jetstream import CONSUMER_INFO_ATTEMPTS, JetStreamEventLog


class TimingOut:
    """Stands in for nats-py's JetStream context: times out ``failures`` times, then answers."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    async def consumer_info(self, stream: str, durable: str) -> Any:
        self.calls += 1
        if self.calls <= self.failures:
            raise nats.errors.TimeoutError
        return f"info of {durable} on {stream}"


def log_with(js: TimingOut) -> JetStreamEventLog:
    log = object.__new__(JetStreamEventLog)
    log._js = js  # type: ignore[assignment]
    log.stream = "GPUPOOL"
    return log


@pytest.fixture(autouse=True)
def no_back_off(monkeypatch: pytest.MonkeyPatch) -> None:
    async def no_sleep(seconds: float) -> None:
        pass

    monkeypatch.setattr(jetstream.asyncio, "sleep", no_sleep)


async def test_consumer_info_is_retried_after_timeouts() -> None:
    js = TimingOut(failures=CONSUMER_INFO_ATTEMPTS - 1)
    assert await log_with(js)._consumer_info("executor") == "info of executor on GPUPOOL"
    assert js.calls == CONSUMER_INFO_ATTEMPTS


async def test_consumer_info_gives_up_after_its_attempts() -> None:
    js = TimingOut(failures=CONSUMER_INFO_ATTEMPTS)
    with pytest.raises(nats.errors.TimeoutError):
        await log_with(js)._consumer_info("executor")
    assert js.calls == CONSUMER_INFO_ATTEMPTS
