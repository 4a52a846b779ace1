"""``LogClient.write_now`` writes the queued frames in order where the socket takes them at
once, and leaves them to nats-py's flusher where it must: not connected, another transport,
the socket's buffer not drained, the flusher gone, or a frame already written this way in
the same turn of the event loop."""

from __future__ import annotations

import asyncio

from nats.aio.client import Client
from nats.aio.transport import TcpTransport

from gpupool.eventlog.log_client import LogClient


class _Socket:
    def __init__(self, buffered: int) -> None:
        self.buffered = buffered

    def get_write_buffer_size(self) -> int:
        return self.buffered


class _Writer:
    def __init__(self, buffered: int = 0) -> None:
        self.transport = _Socket(buffered)
        self.written: list[bytes] = []

    def writelines(self, frames: list[bytes]) -> None:
        self.written += frames


async def client_with(writer: _Writer, *, status: int = Client.CONNECTED) -> LogClient:
    client = LogClient()
    transport = TcpTransport()  # type: ignore[no-untyped-call]
    transport._io_writer = writer  # type: ignore[assignment]
    client._transport = transport
    client._status = status
    client._flusher_task = asyncio.get_running_loop().create_future()  # type: ignore[assignment]
    client._pending = [b"PUB a 1\r\n1\r\n", b"PUB b 1\r\n2\r\n"]
    client._pending_data_size = sum(len(frame) for frame in client._pending)
    return client


async def test_queued_frames_are_written_in_order_and_the_queue_emptied() -> None:
    writer = _Writer()
    client = await client_with(writer)
    assert client.write_now()
    assert writer.written == [b"PUB a 1\r\n1\r\n", b"PUB b 1\r\n2\r\n"]
    assert client._pending == []
    assert client._pending_data_size == 0


async def test_a_second_write_in_the_same_turn_is_left_to_the_flusher_and_the_next_turn_writes() -> (
    None
):
    writer = _Writer()
    client = await client_with(writer)
    assert client.write_now()
    client._pending = [b"PUB c 1\r\n3\r\n"]
    client._pending_data_size = 12
    assert not client.write_now()
    assert client._pending == [b"PUB c 1\r\n3\r\n"]
    await asyncio.sleep(0)  # one turn of the loop: the reset scheduled by the first write ran
    assert client.write_now()
    assert writer.written[-1] == b"PUB c 1\r\n3\r\n"


async def test_a_write_that_does_not_take_the_turn_leaves_the_next_write_to_this_step() -> None:
    writer = _Writer()
    client = await client_with(writer)
    assert client.write_now(takes_turn=False)  # a batch's acks, its last frames
    client._pending = [b"PUB c 1\r\n3\r\n"]
    client._pending_data_size = 12
    assert client.write_now()  # a decision made next in the same step
    assert writer.written[-1] == b"PUB c 1\r\n3\r\n"
    client._pending = [b"PUB d 1\r\n4\r\n"]
    client._pending_data_size = 12
    assert not client.write_now(takes_turn=False)  # that one took the turn
    assert client._pending == [b"PUB d 1\r\n4\r\n"]


async def test_frames_wait_for_the_flusher_while_the_socket_buffer_holds_data() -> None:
    writer = _Writer(buffered=1)
    client = await client_with(writer)
    assert not client.write_now()
    assert writer.written == []
    assert len(client._pending) == 2


async def test_frames_wait_in_the_queue_while_reconnecting() -> None:
    writer = _Writer()
    client = await client_with(writer, status=Client.RECONNECTING)
    assert not client.write_now()
    assert writer.written == []
    assert len(client._pending) == 2


async def test_frames_are_left_to_nats_py_when_the_flusher_has_ended_or_for_another_transport() -> (
    None
):
    ended = await client_with(_Writer())
    assert ended._flusher_task is not None
    ended._flusher_task.cancel()
    await asyncio.sleep(0)
    assert not ended.write_now()
    other = await client_with(_Writer())
    other._transport = object()  # type: ignore[assignment]
    assert not other.write_now()
    assert len(other._pending) == 2
