"""Envelope ids: unique across processes and restarts, at a counter's cost.

An id is 32 lower-case hex digits, the form ``uuid.uuid4().hex`` gave: 16 digits drawn
at random (``os.urandom``, 64 bits) once per process, then a 16-digit counter that the
process counts up from a random start. Within a process two ids never repeat (the counter
would have to wrap 2**64); a fork draws a new random half in the child (``os.register_at_fork``),
so parent and child never share one. Two processes (or two lives of one service across a
restart) share an id only if their random halves collide: for a million process starts
ever, about 3 in 100 million, and even then their counters must meet. ``uuid4`` drew 122
random bits per id at about ten times the CPU (docs/benchmarks.md, "The admission-queue's
CPU per placement, outside the wire"). The id is a message id the server deduplicates on
(``Nats-Msg-Id``) and a key of the applied-ids set: only uniqueness matters, nobody
parses it.
"""

from __future__ import annotations

import itertools
import os

__all__ = ["new_id"]


def _draw() -> None:
    global _prefix, _counter
    _prefix = os.urandom(8).hex()
    _counter = itertools.count(int.from_bytes(os.urandom(4)))


_prefix = ""
_counter = itertools.count()
_draw()
os.register_at_fork(after_in_child=_draw)


def new_id() -> str:
    """A fresh envelope id (32 hex digits), unique across processes and restarts."""
    return f"{_prefix}{next(_counter) & 0xFFFFFFFFFFFFFFFF:016x}"
