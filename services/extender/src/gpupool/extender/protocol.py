"""The scheduler extender protocol (k8s.io/kube-scheduler/extender/v1), as kube-scheduler speaks it.

    POST /filter      ExtenderArgs {pod, nodes{items} | nodenames}
                      → ExtenderFilterResult {nodes{items} | nodenames, failedNodes{name: reason}, error}
    POST /prioritize  ExtenderArgs → HostPriorityList [{host, score}], score 0..MAX_EXTENDER_PRIORITY

Field names are the Go types' JSON tags; Go decodes them case-insensitively, so
this decoder accepts any case of the top-level keys too (``Pod``, ``NodeNames``).
Nodes passed in ``nodes.items`` are returned as they came (raw JSON).
"""

from __future__ import annotations

from typing import Any

import msgspec

MAX_EXTENDER_PRIORITY = 10


class NodeItems(msgspec.Struct, kw_only=True):
    items: list[msgspec.Raw] = []


class ExtenderArgs(msgspec.Struct, kw_only=True):
    pod: msgspec.Raw
    nodes: NodeItems | None = None
    node_names: list[str] | None = msgspec.field(default=None, name="nodenames")


class ExtenderFilterResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    nodes: NodeItems | None = None
    node_names: list[str] | None = msgspec.field(default=None, name="nodenames")
    failed_nodes: dict[str, str] = msgspec.field(default_factory=dict, name="failedNodes")
    error: str = ""


class HostPriority(msgspec.Struct, kw_only=True):
    host: str
    score: int


_TOP = msgspec.json.Decoder(dict[str, msgspec.Raw])
_KEYS = {"pod": "pod", "nodes": "nodes", "nodenames": "nodenames"}


def decode_args(body: bytes) -> ExtenderArgs:
    """Decode ExtenderArgs; raises msgspec.DecodeError / ValidationError on bad input."""
    fields: dict[str, Any] = {}
    for key, value in _TOP.decode(body).items():
        name = _KEYS.get(key.lower())
        if name is not None:
            fields[name] = value
    if "pod" not in fields:
        raise msgspec.ValidationError("ExtenderArgs has no pod")
    nodes = fields.get("nodes")
    names = fields.get("nodenames")
    return ExtenderArgs(
        pod=fields["pod"],
        nodes=_decode_items(nodes) if nodes is not None and bytes(nodes) != b"null" else None,
        node_names=msgspec.json.decode(names, type=list[str] | None) if names is not None else None,
    )


def _decode_items(raw: msgspec.Raw) -> NodeItems:
    fields = {
        k.lower(): v for k, v in msgspec.json.decode(raw, type=dict[str, msgspec.Raw]).items()
    }
    items = fields.get("items")
    if items is None:
        return NodeItems()
    return NodeItems(items=msgspec.json.decode(items, type=list[msgspec.Raw] | None) or [])


def encode(value: ExtenderFilterResult | list[HostPriority]) -> bytes:
    return msgspec.json.encode(value)
