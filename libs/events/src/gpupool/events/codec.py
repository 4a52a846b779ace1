"""Wire format of the log: JSON envelopes, schema versions and upcasters.

Version history (``Envelope.schema``):

* 1 — shares in ``PodRegistered`` were fractions of a GPU (``0.5``), as the
  original annotation format writes them; ``Assigned`` had no ``gpu_uuid``.
* 2 — shares are integer percentages (``50``), ``Assigned.gpu_uuid`` exists.

Log entries (``LogEntry.schema``, the same counter one level up):

* 1, 2 — an entry is one envelope (the only kind of entry before version 3).
* 3 — a *decision entry*: the envelopes (version 2) of one decision, all for one
  node, committed together as one stream message. :func:`decode_entry` reads every
  version and returns the envelopes of the entry (one for versions 1 and 2).

A log may hold entries of any known version; they are upcast on read. An
entry with a version this code does not know fails loudly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from gpupool.events.model import Envelope, Event, event_node

SCHEMA_VERSION = 2
"""The version of an envelope (the events it may hold)."""

ENTRY_SCHEMA_VERSION = 3
"""The version of a decision entry: several version-2 envelopes in one log entry."""

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


class LogEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One log entry holding a whole decision: every envelope commits, or none does."""

    envelopes: tuple[Envelope, ...]
    schema: int = ENTRY_SCHEMA_VERSION


_encoder = msgspec.json.Encoder()
_entry_decoder = msgspec.json.Decoder(LogEntry)
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
    if version == ENTRY_SCHEMA_VERSION:
        raise EventDecodeError(
            "this is a decision entry (schema 3) holding several envelopes: read it with decode_entry"
        )
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


def encode_entry(envelopes: tuple[Envelope, ...] | list[Envelope]) -> bytes:
    """The bytes of one log entry: a bare envelope for one, a decision entry for several."""
    if not envelopes:
        raise ValueError("a log entry holds at least one envelope")
    if len(envelopes) == 1:
        return encode_envelope(envelopes[0])
    nodes = {event_node(envelope.event) for envelope in envelopes}
    if len(nodes) > 1:
        raise ValueError(f"a decision entry is for one node, got {sorted(nodes)}")
    return _encoder.encode(LogEntry(envelopes=tuple(envelopes)))


def decode_entry(data: bytes) -> tuple[Envelope, ...]:
    """The envelopes of one log entry of any version; EventDecodeError on bad input."""
    try:
        version = _probe.decode(data).schema
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"not a gpupool envelope: {exc}") from exc
    if version != ENTRY_SCHEMA_VERSION:
        return (decode_envelope(data),)
    try:
        entry = _entry_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"invalid decision entry: {exc}") from exc
    if not entry.envelopes:
        raise EventDecodeError("invalid decision entry: it holds no envelope")
    for envelope in entry.envelopes:
        if envelope.schema != SCHEMA_VERSION:
            raise UnknownSchemaVersion(
                f"decision entry holds an envelope of schema {envelope.schema}; "
                f"it must be {SCHEMA_VERSION}"
            )
    if len({event_node(envelope.event) for envelope in entry.envelopes}) > 1:
        raise EventDecodeError("invalid decision entry: its envelopes are for several nodes")
    return entry.envelopes


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
