"""The bounds of the log's JetStream stream (docs/eventlog.md, "Bounds and retention").

The log is an append-only audit trail: nothing in it may be dropped silently. So the
stream is bounded in total size (``max_bytes``) and in entry size (``max_msg_size``:
the largest entry the decoder reads) with ``discard: new``: when the stream is full,
an append is *refused* (JetStream error 10077, "maximum bytes exceeded") and the
service reports it, instead of JetStream deleting the oldest entries a rebuild needs.
Space is made by archiving (``gpupool log archive``) and by an operator's purge after
an archive; see docs/eventlog.md.

``GPUPOOL_STREAM_MAX_BYTES`` sets the total size (bytes, or with a ``KiB``/``MiB``/
``GiB``/``TiB`` suffix); the deployments set it below their JetStream store.
"""

from __future__ import annotations

import os
import re

import msgspec
from nats.js import api

from gpupool.events.limits import MAX_ENTRY_BYTES

DEFAULT_MAX_BYTES = 1024**3
"""1 GiB: about three million entries of a few hundred bytes."""

MAX_BYTES_ENV = "GPUPOOL_STREAM_MAX_BYTES"

_SIZE = re.compile(r"\s*([0-9]+)\s*(B|KiB|MiB|GiB|TiB)?\s*")
_UNITS = {None: 1, "B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4}


class StreamLimits(msgspec.Struct, frozen=True, kw_only=True):
    max_bytes: int = DEFAULT_MAX_BYTES
    max_msg_size: int = MAX_ENTRY_BYTES
    discard: api.DiscardPolicy = api.DiscardPolicy.NEW

    @classmethod
    def from_environment(cls) -> StreamLimits:
        text = os.environ.get(MAX_BYTES_ENV)
        return cls() if not text else cls(max_bytes=parse_size(text))

    def differs_from(self, config: api.StreamConfig) -> bool:
        """Whether an existing stream's configuration lacks these bounds."""
        return (
            config.max_bytes != self.max_bytes
            or config.max_msg_size != self.max_msg_size
            or config.discard != self.discard
        )


def parse_size(text: str) -> int:
    """``"6GiB"`` -> 6442450944; a ValueError naming the setting otherwise."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(f"{MAX_BYTES_ENV}={text!r} is not a size (e.g. 6GiB, 512MiB, 1000000)")
    size = int(match.group(1)) * _UNITS[match.group(2)]
    if size < MAX_ENTRY_BYTES:
        raise ValueError(f"{MAX_BYTES_ENV}={text!r} is smaller than one entry ({MAX_ENTRY_BYTES})")
    return size
