"""Where each entry of the log lives: ``<prefix>.<node_token>.<writer>``.

The node token is the entry's node with ``.`` replaced by ``_`` (Kubernetes node
names never contain ``_``), or ``_`` for events that belong to no node. The
writer token names the service that appended the entry (``policy``,
``admission-queue``, ``preemption``, ``node-executor``), so that NATS publish
permissions can be granted per writer and per node. The per-node wildcard
``<prefix>.<node_token>.>`` is what optimistic concurrency and the node filters of
replay and subscribe match on.

Logs written before the writer token (``<prefix>.<node_token>.<event tag>`` and
``….Decision``) read the same: readers take the node from the next-to-last token
and never interpret the last one.
"""

from __future__ import annotations

import re
from functools import lru_cache

from gpupool.events import NODELESS, Event, event_node

DEFAULT_SUBJECT_PREFIX = "gpupool.log"
"""Subjects of the production log; tests use their own prefix per stream."""

NODELESS_TOKEN = "_"

_NOT_IN_A_TOKEN = re.compile(r"[\s*>]")

WRITERS = ("policy", "admission-queue", "preemption", "node-executor")
"""The services that append to the log, each under its own writer token."""

DEFAULT_WRITER = "gpupool"
"""The writer token of appends made outside the four services (tools, benchmarks, tests)."""

SIMULATOR_WRITER = "simulator"
"""The writer named in the subjects of a JSON-lines log, which ``gpupool simulate`` wrote."""

_WRITER_TOKEN = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")


def writer_token(writer: str) -> str:
    """A writer's subject token: lower-case letters, digits and ``-``, at most 63."""
    if not _WRITER_TOKEN.fullmatch(writer):
        raise ValueError(f"writer {writer!r} cannot be a subject token (a-z, 0-9, -; 1-63)")
    return writer


@lru_cache(maxsize=4096)
def node_token(node: str) -> str:
    """The subject token of a node: dots become underscores, no node becomes ``_``."""
    if node == NODELESS:
        return NODELESS_TOKEN
    token = node.replace(".", "_")
    if token == NODELESS_TOKEN or _NOT_IN_A_TOKEN.search(token):
        raise ValueError(f"node name {node!r} cannot be a NATS subject token")
    return token


def node_of_subject(subject: str) -> str | None:
    """The node a log subject names (the inverse of :func:`node_token`); None for ``_``."""
    parts = subject.split(".")
    if len(parts) < 3:
        return None
    token = parts[-2]
    return None if token == NODELESS_TOKEN else token.replace("_", ".")


def writer_of_subject(subject: str) -> str | None:
    """The writer token of a log subject (None if it has too few tokens)."""
    parts = subject.split(".")
    return parts[-1] if len(parts) >= 3 else None


def node_entry_subject(
    node: str, *, writer: str = DEFAULT_WRITER, prefix: str = DEFAULT_SUBJECT_PREFIX
) -> str:
    """The subject of ``writer``'s entries for ``node``, e.g. ``gpupool.log.gpu-node-1.policy``."""
    return f"{prefix}.{node_token(node)}.{writer_token(writer)}"


def subject_for(
    event: Event, *, prefix: str = DEFAULT_SUBJECT_PREFIX, writer: str = DEFAULT_WRITER
) -> str:
    """The subject an entry holding ``event`` is appended on by ``writer``."""
    return node_entry_subject(event_node(event), writer=writer, prefix=prefix)


def writer_subject_filter(
    writer: str, node: str | None = None, *, prefix: str = DEFAULT_SUBJECT_PREFIX
) -> str:
    """Every subject ``writer`` appends on (for one node, or every node and ``_``)."""
    token = "*" if node is None else node_token(node)
    return f"{prefix}.{token}.{writer_token(writer)}"


def node_subject_filter(node: str | None, *, prefix: str = DEFAULT_SUBJECT_PREFIX) -> str:
    """All entries of one node (``None``: the whole log)."""
    if node is None:
        return f"{prefix}.>"
    return f"{prefix}.{node_token(node)}.>"


def subject_matches(subject: str, subject_filter: str) -> bool:
    """Whether ``subject`` is matched by a filter of the form ``a.b.>`` (or an exact subject)."""
    if subject_filter.endswith(".>"):
        return subject.startswith(subject_filter[:-1]) and len(subject) > len(subject_filter) - 1
    return subject == subject_filter
