"""Wire format of the log: JSON envelopes, schema versions and upcasters.

Version history (``Envelope.schema``):

* 1 — shares in ``PodRegistered`` were fractions of a GPU (``0.5``), as the
  source document writes them; ``Assigned`` had no ``gpu_uuid``.
* 2 — shares are integer percentages (``50``), ``Assigned.gpu_uuid`` exists.

A log may hold entries of any known version; they are upcast on read. An
entry with a version this code does not know fails loudly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from gpupool.events.model import Envelope, Event

SCHEMA_VERSION = 2

RawEnvelope = dict[str, Any]
Upcaster = Callable[[RawEnvelope], RawEnvelope]


class EventDecodeError(ValueError):
    """The bytes are not an envelope this code can read (the message says why)."""


class UnknownSchemaVersion(EventDecodeError):
    """The envelope's schema version is newer, or older, than any this code can read."""


class _SchemaProbe(msgspec.Struct):
    schema: int = SCHEMA_VERSION


def _upcast_v1_v2(raw: RawEnvelope) -> RawEnvelope:
    event = dict(raw["event"])
    if event.get("type") == "PodRegistered":
        for field in ("requests", "limits"):
            share = event[field]
            event[field] = {k: round(float(v) * 100) for k, v in share.items()}
    if event.get("type") == "Assigned":
        event.setdefault("gpu_uuid", "")
    return {**raw, "event": event, "schema": 2}


UPCASTERS: dict[int, Upcaster] = {1: _upcast_v1_v2}
"""``UPCASTERS[n]`` turns a version-``n`` envelope into version ``n + 1``."""

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Envelope)
_probe = msgspec.json.Decoder(_SchemaProbe)


def encode_envelope(envelope: Envelope) -> bytes:
    return _encoder.encode(envelope)


def decode_envelope(data: bytes) -> Envelope:
    """Decode one log entry, upcasting older schema versions; raise EventDecodeError on bad input."""
    try:
        version = _probe.decode(data).schema
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"not a gpupool envelope: {exc}") from exc
    if version == SCHEMA_VERSION:
        try:
            return _decoder.decode(data)
        except msgspec.DecodeError as exc:
            raise EventDecodeError(f"invalid envelope: {exc}") from exc
    if version > SCHEMA_VERSION or version not in UPCASTERS:
        raise UnknownSchemaVersion(
            f"envelope schema version {version} is unknown to this gpupool "
            f"(it reads versions {min(UPCASTERS)}..{SCHEMA_VERSION})"
        )
    raw: RawEnvelope = msgspec.json.decode(data)
    try:
        while raw.get("schema", SCHEMA_VERSION) < SCHEMA_VERSION:
            raw = UPCASTERS[int(raw["schema"])](raw)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise EventDecodeError(
            f"invalid version-{version} envelope, cannot upcast it: {exc!r}"
        ) from exc
    try:
        return _decoder.decode(_encoder.encode(raw))
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"invalid envelope after upcasting: {exc}") from exc


def event_json_schema() -> dict[str, Any]:
    """JSON Schema of the envelope and every event (checked in as docs/events.schema.json)."""
    schema: dict[str, Any] = msgspec.json.schema(Envelope)
    return schema


def decode_event(data: bytes) -> Event:
    """Decode a bare event (no envelope), as the golden samples are written."""
    try:
        return msgspec.json.decode(data, type=Event)
    except msgspec.DecodeError as exc:
        raise EventDecodeError(str(exc)) from exc
