"""Reading the log through a consumer the reader's credential names: for authenticated servers.

nats-py's ordered consumers are created on the JetStream API subject that carries no
consumer name (``$JS.API.CONSUMER.CREATE.<stream>``), and a request there may name
*any* consumer in its body: the server then updates that consumer — another
service's durable included (its filter, its inactivity threshold: removed a second
later). So no credential of a deployment may use that subject
(:mod:`gpupool.eventlog.credentials`), and an authenticated reader reads through one
of its own *replay slots* instead (``<user>-replay-<k>``, :func:`replay_names`):
created with the ``create`` action (refused if another reader holds the slot),
pulled in batches without acks, kept in memory, and deleted when the read ends
(a crashed reader's slot expires after :data:`REPLAY_INACTIVE_SECONDS`).

A log's replay (:meth:`JetStreamEventLog.replay`) pulls its slot with raw pulls
(:mod:`gpupool.eventlog.pulled_replay`, :func:`open_replay_slot`); :func:`named_replay`
hands out nats-py messages (headers, times) to the read-only reader.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg

from gpupool.eventlog.pulled_replay import (
    REPLAY_INACTIVE_SECONDS,
    REQUEST_TIMEOUT_S,
    Opener,
    api_request,
    pending_of,
    replay_consumer_config,
)

logger = logging.getLogger(__name__)

REPLAY_SLOTS = 16
"""Reads at once per user (a service's rebuild and catch-ups, readers of the console)."""

REPLAY_BATCH = 1024
PULL_EXPIRES_S = 5.0
CLAIM_RETRY_S = 1.0
CONSUMER_EXISTS = 10148


def replay_names(base: str, *, slots: int = REPLAY_SLOTS) -> tuple[str, ...]:
    """The replay consumers a user may create, pull from and delete."""
    return tuple(f"{base}-replay-{slot}" for slot in range(slots))


def open_replay_slot(nc: Any, stream: str, base: str, subject_filter: str) -> Opener:
    """An opener (:mod:`gpupool.eventlog.pulled_replay`) claiming one of ``base``'s replay
    slots from a sequence: (its name, its pending entries)."""

    async def open_slot(start: int) -> tuple[str, int]:
        name, answer = await _claim(nc, stream, base, subject_filter, start)
        return name, pending_of(answer)

    return open_slot


async def _claim(
    nc: Any, stream: str, base: str, subject_filter: str, start: int
) -> tuple[str, dict[str, Any]]:
    """A free replay slot, created from ``start``: (its name, the create's answer)."""
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + REPLAY_INACTIVE_SECONDS + 30
    while True:
        for name in replay_names(base):
            config = replay_consumer_config(name, subject_filter, start)
            body = {"stream_name": stream, "action": "create", "config": config.as_dict()}
            try:
                answer = await api_request(
                    nc, f"$JS.API.CONSUMER.CREATE.{stream}.{name}.{subject_filter}", body
                )
            except nats.js.errors.APIError as error:
                if error.err_code == CONSUMER_EXISTS:
                    continue  # another read holds it
                raise
            return name, answer
        if loop.time() > give_up_at:
            raise nats.errors.TimeoutError
        logger.warning("every replay slot of %s is in use; waiting for one", base)
        await asyncio.sleep(CLAIM_RETRY_S)  # the server announces no free slot


async def named_replay(
    nc: Any,
    *,
    stream: str,
    base: str,
    subject_filter: str,
    start: int,
    until: int | None,
) -> AsyncIterator[Msg]:
    """The stream's messages on ``subject_filter`` from ``start``, in order: up to ``until``
    (its sequence included), or for ever (following)."""
    name, _ = await _claim(nc, stream, base, subject_filter, start)
    inbox = nc.new_inbox()
    queue: asyncio.Queue[Msg] = asyncio.Queue()

    async def on_msg(msg: Msg) -> None:
        queue.put_nowait(msg)

    subscription = await nc.subscribe(inbox, cb=on_msg)
    request = json.dumps({"batch": REPLAY_BATCH, "expires": int(PULL_EXPIRES_S * 1e9)}).encode()
    try:
        while True:
            await nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{name}", request, reply=inbox)
            received = 0
            while received < REPLAY_BATCH:
                async with asyncio.timeout(PULL_EXPIRES_S + REQUEST_TIMEOUT_S):
                    msg = await queue.get()
                status = msg.headers.get("Status") if msg.headers else None
                if status is not None:
                    description = msg.headers.get("Description", "") if msg.headers else ""
                    if status == "409" and "Deleted" in description:
                        raise nats.errors.Error(f"replay consumer {name} was deleted")
                    if status in ("404", "408", "409"):
                        break  # the request ended (expired, no messages, limits): ask again
                    continue  # a heartbeat
                received += 1
                yield msg
                if until is not None and msg.metadata.sequence.stream >= until:
                    return
    finally:
        with contextlib.suppress(nats.errors.Error, OSError, TimeoutError):
            await subscription.unsubscribe()
        with contextlib.suppress(nats.errors.Error, OSError, TimeoutError):
            await nc.request(f"$JS.API.CONSUMER.DELETE.{stream}.{name}", b"", timeout=2)
