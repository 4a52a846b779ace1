"""Where each entry of the log lives: ``<prefix>.<node_token>.<tag>``.

The node token is the event's node with ``.`` replaced by ``_`` (Kubernetes node
names never contain ``_``), or ``_`` for events that belong to no node. The
per-node wildcard ``<prefix>.<node_token>.>`` is what optimistic concurrency and
the node filters of replay and subscribe match on.
"""

from __future__ import annotations

import re
from functools import lru_cache

from gpupool.events import NODELESS, Event, event_node, event_tag

DEFAULT_SUBJECT_PREFIX = "gpupool.log"
"""Subjects of the production log; tests use their own prefix per stream."""

NODELESS_TOKEN = "_"

_NOT_IN_A_TOKEN = re.compile(r"[\s*>]")


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


def subject_for(event: Event, *, prefix: str = DEFAULT_SUBJECT_PREFIX) -> str:
    """The subject an event is appended on, e.g. ``gpupool.log.gpu-node-1.PodReady``."""
    return f"{prefix}.{node_token(event_node(event))}.{event_tag(event)}"


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
