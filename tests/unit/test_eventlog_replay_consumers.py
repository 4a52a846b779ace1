"""A replay's consumer is configured the same whoever opens it: an authenticated log's
replay slot (``named_replay.open_replay_slot``) and an unauthenticated log's consumer
under a random name (``pulled_replay.open_ephemeral``) differ in their name only."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gpupool.eventlog import named_replay, pulled_replay

STREAM = "GPUPOOL"
FILTER = "gpupool.node.n1.>"


class Reply:
    def __init__(self, data: bytes) -> None:
        self.data = data


class RecordingConnection:
    """Answers each consumer create as the server does when it creates the consumer
    (``num_pending``), or refuses the names in ``taken`` (the slot is held)."""

    def __init__(self, taken: frozenset[str] = frozenset()) -> None:
        self.creates: list[tuple[str, dict[str, Any]]] = []
        self.taken = taken

    async def request(self, subject: str, payload: bytes, timeout: float) -> Reply:
        body = json.loads(payload)
        self.creates.append((subject, body))
        name = body["config"]["name"]
        if name in self.taken:
            error = {"code": 400, "err_code": named_replay.CONSUMER_EXISTS, "description": "x"}
            return Reply(json.dumps({"error": error}).encode())
        return Reply(json.dumps({"name": name, "num_pending": 42}).encode())


def without_name(config: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in config.items() if key != "name"}


@pytest.mark.parametrize("start", [0, 1, 500])
async def test_a_replay_slot_is_the_same_consumer_as_an_ephemeral_replay_but_for_its_name(
    start: int,
) -> None:
    slots = RecordingConnection(taken=frozenset({"reader-replay-0"}))
    name, pending = await named_replay.open_replay_slot(slots, STREAM, "reader", FILTER)(start)
    ephemeral = RecordingConnection()
    _, ephemeral_pending = await pulled_replay.open_ephemeral(ephemeral, STREAM, FILTER)(start)

    assert (name, pending, ephemeral_pending) == ("reader-replay-1", 42, 42)
    assert [subject for subject, _ in slots.creates] == [
        f"$JS.API.CONSUMER.CREATE.{STREAM}.reader-replay-{k}.{FILTER}" for k in (0, 1)
    ]
    (_, slot_body), (_, ephemeral_body) = slots.creates[-1], ephemeral.creates[0]
    assert slot_body["action"] == ephemeral_body["action"] == "create"
    assert slot_body["config"]["name"] == name
    assert without_name(slot_body["config"]) == without_name(ephemeral_body["config"])
    expected = pulled_replay.replay_consumer_config(name, FILTER, start).as_dict()
    assert slot_body["config"] == json.loads(json.dumps(expected))
