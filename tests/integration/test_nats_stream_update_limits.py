"""What a stream update can do to the log: the residual risk of the ``stream-admin`` credential.

``stream-admin`` (the ensure-stream step) may update the stream's configuration, and NATS
cannot restrict an update to some fields. docs/security.md ("Residual risks") says exactly
what that allows; these tests measure it on the real nats-server, so the doc stays true if
the server's behaviour changes: a switch to ``discard: old`` with a lower ``max_msgs`` drops
the oldest entries (an effective purge, which no purge denial stops, nor the stream's
``deny_delete`` / ``deny_purge`` flags); a lower ``max_msgs`` under ``discard: new`` drops
nothing; and ``deny_delete`` / ``deny_purge`` once set cannot be unset by an update.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator

import nats
import nats.js.errors
import pytest
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, StreamConfig

pytestmark = pytest.mark.integration

ENTRIES = 10


@pytest.fixture
async def js(nats_url: str) -> AsyncIterator[JetStreamContext]:
    nc = await nats.connect(nats_url)
    try:
        yield nc.jetstream(timeout=5)
    finally:
        await nc.close()


async def stream_of_ten(js: JetStreamContext, *, deny: bool) -> StreamConfig:
    token = uuid.uuid4().hex[:12]
    stream, prefix = f"TEST_{token}", f"test_{token}.log"
    await js.add_stream(
        StreamConfig(
            name=stream,
            subjects=[f"{prefix}.>"],
            discard=DiscardPolicy.NEW,  # as gpupool makes it
            max_msgs=-1,
            deny_delete=deny,
            deny_purge=deny,
        )
    )
    for _ in range(ENTRIES):
        await js.publish(f"{prefix}.node.policy", b"{}")
    info = await js.stream_info(stream)
    assert info.state.messages == ENTRIES
    return info.config


@pytest.mark.parametrize("deny", [False, True], ids=["plain", "deny_delete+deny_purge"])
async def test_an_update_to_discard_old_with_a_lower_max_msgs_drops_the_oldest_entries(
    js: JetStreamContext, deny: bool
) -> None:
    config = await stream_of_ten(js, deny=deny)
    try:
        await js.update_stream(dataclasses.replace(config, max_msgs=1, discard=DiscardPolicy.OLD))
        state = (await js.stream_info(config.name or "")).state
        assert (state.messages, state.first_seq) == (1, ENTRIES)
    finally:
        await js.delete_stream(config.name or "")


async def test_a_lower_max_msgs_under_discard_new_drops_nothing(js: JetStreamContext) -> None:
    config = await stream_of_ten(js, deny=False)
    try:
        await js.update_stream(dataclasses.replace(config, max_msgs=1))
        assert (await js.stream_info(config.name or "")).state.messages == ENTRIES
    finally:
        await js.delete_stream(config.name or "")


async def test_deny_delete_and_deny_purge_cannot_be_unset_by_an_update(
    js: JetStreamContext,
) -> None:
    config = await stream_of_ten(js, deny=True)
    try:
        with pytest.raises(nats.js.errors.Error):
            await js.update_stream(dataclasses.replace(config, deny_delete=False, deny_purge=False))
        after = (await js.stream_info(config.name or "")).config
        assert (after.deny_delete, after.deny_purge) == (True, True)
    finally:
        await js.delete_stream(config.name or "")
