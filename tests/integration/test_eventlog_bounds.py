"""The log's stream is bounded on a real nats-server, and a full log loses nothing.

The stream the services create has ``max_bytes``, ``max_msg_size`` (the largest entry
the decoder reads) and ``discard: new``: an entry over the size limit is refused, and
when the stream is full further appends are refused while every entry already in it
stays readable from sequence 1 (JetStream deleting the oldest entries would leave
a rebuild without the pods' registrations).
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.js.api import DiscardPolicy

from gpupool.eventlog import JetStreamEventLog
from gpupool.eventlog.port import StoredEvent
from gpupool.eventlog.stream_limits import StreamLimits, parse_size
from gpupool.events import Envelope, MessageRejected
from gpupool.events.limits import MAX_ENTRY_BYTES

pytestmark = pytest.mark.integration

T0 = datetime(2025, 4, 22, 8, 0, 0, tzinfo=UTC)
SMALL = 2 * 1024 * 1024


def bulky(number: int) -> Envelope:
    """An entry of about 4 KB."""
    return Envelope(
        id=f"bulky-{number}",
        time=T0,
        event=MessageRejected(subject="x.y.z", reason="fill", payload="p" * 4000, seq=number),
    )


async def test_the_stream_is_bounded_and_a_full_log_refuses_appends_losing_nothing(
    nats_url: str,
) -> None:
    token = uuid.uuid4().hex[:10]
    stream, prefix = f"BOUNDS_{token}", f"bounds_{token}.log"
    log = await JetStreamEventLog.connect(
        nats_url, stream=stream, subject_prefix=prefix, limits=StreamLimits(max_bytes=SMALL)
    )
    nc = await nats.connect(nats_url)
    try:
        info = await nc.jetstream().stream_info(stream)
        assert (info.config.max_bytes, info.config.max_msg_size, info.config.discard) == (
            SMALL,
            MAX_ENTRY_BYTES,
            DiscardPolicy.NEW,
        )
        # the server's max_payload equals the entry limit: the client refuses it already
        with pytest.raises((nats.errors.MaxPayloadError, nats.js.errors.APIError)):
            await log.append_raw(f"{prefix}.n1.PodReady", b"x" * (MAX_ENTRY_BYTES + 1))
        appended = 0
        refused: nats.js.errors.APIError | None = None
        while refused is None and appended < 2 * SMALL // 4000:
            try:
                await log.append(bulky(appended + 1))
            except nats.js.errors.APIError as error:
                refused = error
            else:
                appended += 1
        assert refused is not None, f"{appended} entries of 4 KB fit in a {SMALL}-byte stream"
        assert "maximum bytes" in str(refused).lower()
        read = [entry async for entry in log.replay()]
        assert len(read) == appended
        first = read[0]
        assert isinstance(first, StoredEvent) and first.seq == 1
        assert first.envelope.id == "bulky-1"
    finally:
        await nc.jetstream().delete_stream(stream)
        await nc.close()
        await log.close()


@pytest.mark.parametrize(
    ("text", "size"), [("6GiB", 6 * 1024**3), ("768MiB", 768 * 1024**2), ("2000000", 2000000)]
)
def test_the_stream_size_setting_reads_binary_units(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["6GB", "lots", "1KiB", "-5"])
def test_a_stream_size_setting_that_is_no_size_is_refused_by_name(text: str) -> None:
    with pytest.raises(ValueError, match="GPUPOOL_STREAM_MAX_BYTES"):
        parse_size(text)
