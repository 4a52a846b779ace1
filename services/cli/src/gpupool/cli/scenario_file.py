"""Read a scenario YAML file into the core's :class:`~gpupool.core.simulation.Scenario`.

Errors name the file, the line and the field path, e.g.::

    scenarios/x.yaml:12: timeline[3].action: 'redy' is not one of ready, complete, ...

The YAML is composed into a node tree (which keeps each node's line) and then
constructed into plain data; msgspec converts the data, and the path in a
``msgspec.ValidationError`` (``$.timeline[3].action``) is walked back through the
node tree to find the line. References between sections (a pod's node, a
timeline action's pod) are checked here too, so they get a line as well.
"""

from __future__ import annotations

import json
import re
import types
import typing
from pathlib import Path
from typing import Any

import msgspec
import yaml

from gpupool.cli.exits import InvalidInput
from gpupool.core.simulation import Scenario

PathSegment = str | int

_MSGSPEC_PATH = re.compile(r"^(?P<problem>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_PATH_SEGMENT = re.compile(r"\.([^.\[]+)|\[(\d+)\]")


class ScenarioFileError(InvalidInput, ValueError):
    """The scenario file is not a valid scenario; the message names file, line and field."""


def load_scenario(path: Path) -> Scenario:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ScenarioFileError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ScenarioFileError(f"{path}: not UTF-8 text: {exc.reason}") from exc
    return parse_scenario(text, source=str(path))


def parse_scenario(text: str, *, source: str = "<scenario>") -> Scenario:
    root, data = _compose_and_construct(text, source)
    if root is None:
        raise ScenarioFileError(f"{source}:1: the file is empty; a scenario needs at least nodes")
    if not isinstance(root, yaml.MappingNode):
        raise ScenarioFileError(
            f"{_where(source, root)}: a scenario is a mapping with nodes, pods and timeline"
        )
    _check_duplicate_keys(root, source, ())
    data = _qos_mappings_as_json(data)
    try:
        scenario = msgspec.convert(data, Scenario)
    except msgspec.ValidationError as exc:
        raise ScenarioFileError(_explain_validation_error(str(exc), root, source)) from exc
    _check_references(scenario, root, source)
    return scenario


# --------------------------------------------------------------------------- YAML


def _compose_and_construct(text: str, source: str) -> tuple[yaml.Node | None, Any]:
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        data = loader.construct_document(root) if root is not None else None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 1
        problem = exc.problem or exc.context or "invalid YAML"
        if exc.problem and exc.context and exc.context_mark is not None:
            problem += f" ({exc.context} started at line {exc.context_mark.line + 1})"
        raise ScenarioFileError(f"{source}:{line}: invalid YAML: {problem}") from exc
    except yaml.YAMLError as exc:
        raise ScenarioFileError(f"{source}: invalid YAML: {exc}") from exc
    finally:
        loader.dispose()
    return root, data


def _where(source: str, node: yaml.Node) -> str:
    return f"{source}:{node.start_mark.line + 1}"


def _check_duplicate_keys(node: yaml.Node, source: str, path: tuple[PathSegment, ...]) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key, value in node.value:
            name = str(key.value)
            if name in seen:
                raise ScenarioFileError(
                    f"{_where(source, key)}: {_format_path((*path, name))}: duplicate key"
                )
            seen.add(name)
            _check_duplicate_keys(value, source, (*path, name))
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _check_duplicate_keys(item, source, (*path, index))


def _qos_mappings_as_json(data: Any) -> Any:
    """A ``qos`` written as a YAML mapping is accepted and turned into the annotation's JSON text."""
    if not isinstance(data, dict):
        return data
    for section in ("nodes", "timeline"):
        items = data.get(section)
        if isinstance(items, list):
            for item in items:
                if isinstance(item, dict) and isinstance(item.get("qos"), dict):
                    item["qos"] = json.dumps(item["qos"])
    return data


# --------------------------------------------------------------------------- paths and lines


def _format_path(path: tuple[PathSegment, ...]) -> str:
    text = ""
    for segment in path:
        text += f"[{segment}]" if isinstance(segment, int) else f".{segment}"
    return text.lstrip(".") or "(top level)"


def _parse_path(text: str) -> tuple[PathSegment, ...]:
    return tuple(int(index) if index else name for name, index in _PATH_SEGMENT.findall(text))


def _child(node: yaml.Node, segment: PathSegment) -> tuple[yaml.Node, yaml.Node] | None:
    """(key node or the item itself, value node) of one path segment, if present."""
    if isinstance(node, yaml.MappingNode) and isinstance(segment, str):
        for key, value in node.value:
            if str(key.value) == segment:
                return key, value
    if (
        isinstance(node, yaml.SequenceNode)
        and isinstance(segment, int)
        and 0 <= segment < len(node.value)
    ):
        item: yaml.Node = node.value[segment]
        return item, item
    return None


def _node_at(root: yaml.Node, path: tuple[PathSegment, ...]) -> yaml.Node:
    """The deepest node along ``path`` (the path may name something absent from the YAML)."""
    node = root
    for segment in path:
        found = _child(node, segment)
        if found is None:
            break
        node = found[1]
    return node


def _key_node(root: yaml.Node, path: tuple[PathSegment, ...], key: str) -> yaml.Node:
    mapping = _node_at(root, path)
    found = _child(mapping, key)
    return found[0] if found is not None else mapping


def _explain_validation_error(message: str, root: yaml.Node, source: str) -> str:
    match = _MSGSPEC_PATH.match(message)
    assert match is not None  # the pattern matches any text
    problem = match.group("problem")
    path = _parse_path(match.group("path") or "")
    node = _node_at(root, path)
    if found := re.fullmatch(r"Object contains unknown field `(.+)`", problem):
        field = found.group(1)
        known = ", ".join(_field_names(path))
        node = _key_node(root, path, field)
        return f"{_where(source, node)}: {_format_path((*path, field))}: unknown field (known fields: {known})"
    if found := re.fullmatch(r"Object missing required field `(.+)`", problem):
        return f"{_where(source, node)}: {_format_path(path)}: missing required field {found.group(1)!r}"
    if found := re.fullmatch(r"Invalid enum value (.+)", problem):
        choices = ", ".join(str(choice) for choice in _literal_choices(path))
        return f"{_where(source, node)}: {_format_path(path)}: {found.group(1)} is not one of {choices}"
    if found := re.fullmatch(r"Expected `(.+)`, got `(.+)`", problem):
        expected, got = found.group(1), found.group(2)
        shown = f" ({_yaml_text(node)})" if isinstance(node, yaml.ScalarNode) else ""
        return (
            f"{_where(source, node)}: {_format_path(path)}: expected {expected}, got {got}{shown}"
        )
    return f"{_where(source, node)}: {_format_path(path)}: {problem}"


def _yaml_text(node: yaml.ScalarNode) -> str:
    return repr(node.value)


# --------------------------------------------------------------------------- the Scenario type


def _type_at(path: tuple[PathSegment, ...]) -> Any:
    """The Python type the Scenario declares at ``path`` (``X | None`` read as ``X``)."""
    kind: Any = Scenario
    for segment in path:
        kind = _unwrap(kind)
        if isinstance(segment, int) and typing.get_origin(kind) is list:
            kind = typing.get_args(kind)[0]
        elif (
            isinstance(segment, str) and isinstance(kind, type) and issubclass(kind, msgspec.Struct)
        ):
            fields = {field.encode_name: field.type for field in msgspec.structs.fields(kind)}
            if segment not in fields:
                return None
            kind = fields[segment]
        else:
            return None
    return _unwrap(kind)


def _unwrap(kind: Any) -> Any:
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        members = [t for t in typing.get_args(kind) if t is not type(None)]
        if len(members) == 1:
            return members[0]
    return kind


def _field_names(path: tuple[PathSegment, ...]) -> list[str]:
    kind = _type_at(path)
    if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
        return [field.encode_name for field in msgspec.structs.fields(kind)]
    return []


def _literal_choices(path: tuple[PathSegment, ...]) -> list[object]:
    """The allowed values, in the order the type declares them."""
    kind = _type_at(path)
    if typing.get_origin(kind) is typing.Literal:
        return list(typing.get_args(kind))
    return []


# --------------------------------------------------------------------------- references


def _check_references(scenario: Scenario, root: yaml.Node, source: str) -> None:
    def fail(path: tuple[PathSegment, ...], problem: str) -> ScenarioFileError:
        return ScenarioFileError(
            f"{_where(source, _node_at(root, path))}: {_format_path(path)}: {problem}"
        )

    nodes = {node.name for node in scenario.nodes}
    pods = {(pod.namespace, pod.name) for pod in scenario.pods}
    for index, pod in enumerate(scenario.pods):
        if pod.node not in nodes:
            raise fail(("pods", index, "node"), f"node {pod.node!r} is not in nodes{_known(nodes)}")
    for index, action in enumerate(scenario.timeline):
        if action.at < 0:
            raise fail(("timeline", index, "at"), "must be 0 or more (seconds since start)")
        if action.action == "set-policy":
            if action.node is None:
                raise fail(("timeline", index), "set-policy needs a node")
            if action.node not in nodes:
                raise fail(
                    ("timeline", index, "node"),
                    f"node {action.node!r} is not in nodes{_known(nodes)}",
                )
            continue
        if action.pod is None:
            raise fail(("timeline", index), f"{action.action} needs a pod")
        if (action.namespace, action.pod) not in pods:
            names = {f"{ns}/{name}" for ns, name in pods}
            raise fail(
                ("timeline", index, "pod"),
                f"pod {action.namespace}/{action.pod} is not in pods{_known(names)}",
            )
    if scenario.start.tzinfo is None:
        raise fail(("start",), "needs a time zone, e.g. 2025-01-01T00:00:00Z")


def _known(names: set[str]) -> str:
    return f" (known: {', '.join(sorted(names))})" if names else ""
