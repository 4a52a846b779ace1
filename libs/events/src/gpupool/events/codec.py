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

Every entry is checked before it is believed: at most ``MAX_ENTRY_BYTES``, nested
no deeper than msgspec's decoder goes (a deeper one is refused, not a
RecursionError), every field of the type and in the range the model declares
(``gpupool.events.limits``). Whatever the bytes, the decoder returns envelopes or
raises :class:`EventDecodeError` saying why: never any other exception.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Sequence
from typing import Any, cast

import msgspec

from gpupool.events.limits import MAX_ENTRY_BYTES
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


class EntryTooLarge(EventDecodeError):
    """The entry is larger than any entry gpupool writes (``MAX_ENTRY_BYTES``)."""


class EntryTooDeep(EventDecodeError):
    """The entry nests JSON deeper than any envelope (refused before it can exhaust the stack)."""


_UPCAST_ERRORS = (KeyError, TypeError, ValueError, AttributeError, OverflowError)
"""What an upcaster may raise on a malformed old entry (``float('inf')`` shares overflow)."""


def _probe_version(data: bytes) -> int:
    """The entry's schema version; refuses what is too large or not an object of the log."""
    if len(data) > MAX_ENTRY_BYTES:
        raise EntryTooLarge(
            f"entry of {len(data)} bytes is larger than the limit of {MAX_ENTRY_BYTES} bytes"
        )
    version: int = _decode_bounded(_probe, data, "not a gpupool envelope").schema
    return version


MAX_JSON_DEPTH = 32
"""Deeper than any entry of the log nests (a decision entry: about 6)."""

_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_BRACKET = re.compile(rb"[\[\]{}]")
_NOT_QUOTE_OR_BRACKET = bytes(c for c in range(256) if c not in b'"[]{}')
_AS_PARENS = bytes.maketrans(b"[]{}", b"()()")


def _json_depth(data: bytes) -> int:
    """How deep ``data`` nests arrays and objects (brackets inside strings do not count)."""
    depth = _json_depth_plain(data)
    return depth if depth is not None else _json_depth_scanned(data)


def _json_depth_plain(data: bytes) -> int | None:
    """``_json_depth`` in a few passes of bytes methods, for the entries the log holds: no
    backslash (so every ``"`` opens or closes a string), balanced brackets. None: anything
    else, or deeper than ``MAX_JSON_DEPTH`` (the character scan then says how deep).

    Outside the strings (every other piece between quotes) only the brackets are kept, as
    parentheses; each round removes every innermost ``()`` pair, so the nesting depth of a
    balanced sequence is the number of rounds until nothing is left. A decision entry of 700
    envelopes: about 1 ms instead of 20 for the character scan."""
    if b"\\" in data:
        return None
    pieces = data.translate(None, _NOT_QUOTE_OR_BRACKET).split(b'"')
    if not len(pieces) % 2:
        return None  # a string is not closed
    brackets = b"".join(pieces[::2]).translate(_AS_PARENS)
    rounds = 0
    while brackets:
        if rounds > MAX_JSON_DEPTH:
            return None
        inner = brackets.replace(b"()", b"")
        if len(inner) == len(brackets):
            return None  # unbalanced
        brackets = inner
        rounds += 1
    return rounds


def _json_depth_scanned(data: bytes) -> int:
    depth = deepest = 0
    for bracket in _BRACKET.findall(_JSON_STRING.sub(b"", data)):
        if bracket in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def _check_depth(data: bytes, what: str) -> None:
    """Refuse nesting past MAX_JSON_DEPTH before decoding: where the decoder's own limit lies
    depends on the interpreter (3.11 raises RecursionError at 1,000; 3.12 may decode on)."""
    if data.count(b"[") + data.count(b"{") <= MAX_JSON_DEPTH:
        return  # cannot nest deeper than it has brackets
    depth = _json_depth(data)
    if depth > MAX_JSON_DEPTH:
        raise EntryTooDeep(
            f"{what}: JSON nested deeper than the decoder reads "
            f"({depth} levels; an entry of the log nests at most {MAX_JSON_DEPTH})"
        )


def _decode_bounded(
    decoder: msgspec.json.Decoder[Any], data: bytes, what: str, *, checked: bool = False
) -> Any:
    """Decode with the depth checked first (``checked``: the caller checked these bytes)."""
    if not checked:
        _check_depth(data, what)
    try:
        return decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"{what}: {exc}") from exc
    except RecursionError as exc:
        raise EntryTooDeep(f"{what}: JSON nested deeper than the decoder reads ({exc})") from exc


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


class LogEntry(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """One log entry holding a whole decision: every envelope commits, or none does."""

    envelopes: tuple[Envelope, ...]
    schema: int = ENTRY_SCHEMA_VERSION


_encoder = msgspec.json.Encoder()
_entry_decoder = msgspec.json.Decoder(LogEntry)
_decoder = msgspec.json.Decoder(Envelope)
_probe = msgspec.json.Decoder(_SchemaProbe)
_raw_decoder: msgspec.json.Decoder[RawEnvelope] = msgspec.json.Decoder(dict[str, Any])


def encode_envelope(envelope: Envelope) -> bytes:
    return _encoder.encode(envelope)


def _decode_current(data: bytes) -> Envelope | None:
    """The common case in one decode: a current-version envelope, small and shallow enough to
    need no depth scan. None: anything else (the checked path then decodes it or says why)."""
    if len(data) > MAX_ENTRY_BYTES:
        return None
    brackets = data.count(b"{")
    if b"[" in data:  # (most entries hold no array: one search instead of a second count)
        brackets += data.count(b"[")
    if brackets > MAX_JSON_DEPTH:
        return None
    try:
        envelope: Envelope = _decoder.decode(data)
    except msgspec.DecodeError:
        return None
    # an older envelope may decode as the current shape but means something else (v1 shares)
    return envelope if envelope.schema == SCHEMA_VERSION else None


def decode_envelope(data: bytes) -> Envelope:
    """Decode one log entry, upcasting older schema versions; raise EventDecodeError on bad input."""
    envelope = _decode_current(data)
    if envelope is not None:
        return envelope
    return _decode_checked(data)


def _decode_checked(data: bytes, version: int | None = None) -> Envelope:
    """``decode_envelope`` step by step: probe the version, refuse or upcast, then decode
    (``version``: the caller probed it already)."""
    if version is None:
        version = _probe_version(data)
    if version == ENTRY_SCHEMA_VERSION:
        raise EventDecodeError(
            "this is a decision entry (schema 3) holding several envelopes: read it with decode_entry"
        )
    if version == SCHEMA_VERSION:
        envelope: Envelope = _decode_bounded(_decoder, data, "invalid envelope")
        return envelope
    if version > SCHEMA_VERSION or version not in UPCASTERS:
        raise UnknownSchemaVersion(
            f"envelope schema version {version} is unknown to this gpupool "
            f"(it reads versions {min(UPCASTERS)}..{SCHEMA_VERSION})"
        )
    raw: RawEnvelope = _decode_bounded(_raw_decoder, data, f"invalid version-{version} envelope")
    try:
        while raw.get("schema", SCHEMA_VERSION) < SCHEMA_VERSION:
            raw = UPCASTERS[int(raw["schema"])](raw)
    except _UPCAST_ERRORS as exc:
        raise EventDecodeError(
            f"invalid version-{version} envelope, cannot upcast it: {exc!r}"
        ) from exc
    try:
        upcast = _encoder.encode(raw)
    except (TypeError, ValueError, OverflowError) as exc:
        raise EventDecodeError(f"invalid envelope after upcasting: {exc!r}") from exc
    upcast_envelope: Envelope = _decode_bounded(
        _decoder, upcast, "invalid envelope after upcasting"
    )
    return upcast_envelope


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


_DECISION_ENTRY_START = b'{"envelopes":'
"""How a decision entry as gpupool writes it starts (its envelopes first)."""


def decode_plain(data: bytes) -> Envelope | None:
    """``decode_entry``'s most frequent case: the entry is one current envelope, small and
    shallow enough to decode at once; None: anything else (``decode_entry`` then reads it
    or says why). Where this returns an envelope, ``decode_entry`` returns it alone."""
    # A decision entry as gpupool writes it, its envelopes first, goes straight to the
    # probe. Any other decision entry never decodes so (it has no ``id``, ``time`` or
    # ``event``, and schema 3), and an entry that does is one the probe reads as that
    # same current envelope.
    if data.startswith(_DECISION_ENTRY_START):
        return None
    return _decode_current(data)


_PLAIN_RUN = 16
"""Fewer entries than this are decoded one by one (``decode_plain_many``)."""
_NOT_OPENING = bytes(c for c in range(256) if c not in b"{[\n")
_SCHEMA = operator.attrgetter("schema")
_FIRST_BYTE = operator.itemgetter(0)
_THIRD_BYTE = operator.itemgetter(2)
_LAST_BYTE = operator.itemgetter(-1)
_OPENING_BRACE, _CLOSING_BRACE = b"{}"
_DECISION_THIRD_BYTE = _DECISION_ENTRY_START[2]


def decode_plain_many(datas: Sequence[bytes]) -> list[Envelope | None]:
    """``[decode_plain(data) for data in datas]``, the entries that are one current envelope
    decoded together, in one call of msgspec (a replay's batch): the same answers.

    Entries are decoded as lines of one buffer only if no value can run from one line onto
    another: no entry holds a line break, each starts with ``{`` and ends with ``}``. A value
    still open at a line's end would then meet that ``}`` and a ``{`` after the line break:
    inside a string the raw line break is refused, and anywhere else in an object or array
    a ``{`` cannot follow a value; so every value ends on its own line, and the decoder
    must return exactly one per line (else two values shared a line). Every entry is held
    to ``decode_plain``'s own conditions (size, brackets, not a decision entry, the current
    schema): decision entries are left out of the joined runs (None, as ``decode_plain``
    answers); a run that breaks another condition before decoding is halved until the
    entries that break it are decoded one by one; a run the decoder refuses (garbage) is
    decoded one by one.

    The shape is checked with a few passes of C over the batch: the set of first, third and
    last bytes (an entry too short for them breaks the shape), then the entries joined with a
    line break between each two, stripped to ``{``, ``[`` and line breaks and split into
    lines: one per entry (more: an entry holds a line break), each with its brackets."""
    count = len(datas)
    if count < _PLAIN_RUN:
        return [decode_plain(data) for data in datas]
    try:
        firsts = set(map(_FIRST_BYTE, datas))
        thirds = set(map(_THIRD_BYTE, datas))
        lasts = set(map(_LAST_BYTE, datas))
    except IndexError:  # an entry of fewer than three bytes: not the shape
        return _halved(datas)
    if _DECISION_THIRD_BYTE in thirds and any(map(_IS_DECISION_ENTRY, datas)):
        return _around_decision_entries(datas)  # decode_entry's: the runs between joined
    if firsts != {_OPENING_BRACE} or lasts != {_CLOSING_BRACE}:
        return _halved(datas)
    joined = b"\n".join(datas)
    if len(joined) - count + 1 > MAX_ENTRY_BYTES and max(map(len, datas)) > MAX_ENTRY_BYTES:
        del joined  # (not held while the halves are decoded)
        return _halved(datas)
    lines = joined.translate(None, _NOT_OPENING).split(b"\n")  # each line's { and [
    # more lines than entries: an entry holds a line break
    if len(lines) != count or max(map(len, lines)) > MAX_JSON_DEPTH:
        del joined, lines  # (not held while the halves are decoded)
        return _halved(datas)
    try:
        decoded = cast(list[Envelope | None], _decoder.decode_lines(joined))
    except (msgspec.DecodeError, RecursionError):  # (no value spans lines: bounded by the
        return [decode_plain(data) for data in datas]  # depth check; caught all the same)
    if len(decoded) != count:  # a line of two values (no line is empty)
        return [decode_plain(data) for data in datas]
    if any(schema != SCHEMA_VERSION for schema in set(map(_SCHEMA, decoded))):
        for index, envelope in enumerate(decoded):
            if envelope is not None and envelope.schema != SCHEMA_VERSION:
                decoded[index] = None  # an older envelope, for decode_entry to upcast
    return decoded


_IS_DECISION_ENTRY = operator.methodcaller("startswith", _DECISION_ENTRY_START)


def _halved(datas: Sequence[bytes]) -> list[Envelope | None]:
    half = len(datas) // 2
    return decode_plain_many(datas[:half]) + decode_plain_many(datas[half:])


def _around_decision_entries(datas: Sequence[bytes]) -> list[Envelope | None]:
    """``decode_plain_many`` of a batch holding decision entries: None for each of those,
    the runs of other entries between them decoded together."""
    answers: list[Envelope | None] = []
    run = 0
    for index, data in enumerate(datas):
        if _IS_DECISION_ENTRY(data):
            if run < index:
                answers += decode_plain_many(datas[run:index])
            answers.append(None)
            run = index + 1
    if run < len(datas):
        answers += decode_plain_many(datas[run:])
    return answers


def decode_entry(data: bytes, *, plain_tried: bool = False) -> tuple[Envelope, ...]:
    """The envelopes of one log entry of any version; EventDecodeError on bad input.

    ``plain_tried``: the caller has had :func:`decode_plain` answer None for these bytes, or
    refused what it answered (it is not decoded so again)."""
    if not plain_tried:
        envelope = decode_plain(data)  # most entries are one current envelope
        if envelope is not None:
            return (envelope,)
    version = _probe_version(data)
    if version != ENTRY_SCHEMA_VERSION:
        return (_decode_checked(data, version),)
    # the same bytes passed the depth check in _probe_version
    entry: LogEntry = _decode_bounded(_entry_decoder, data, "invalid decision entry", checked=True)
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
    if len(data) > MAX_ENTRY_BYTES:
        raise EntryTooLarge(f"event of {len(data)} bytes is larger than {MAX_ENTRY_BYTES} bytes")
    event: Event = _decode_bounded(_event_decoder, data, "invalid event")
    return event


_event_decoder: msgspec.json.Decoder[Event] = msgspec.json.Decoder(Event)
