"""Validation of pod specs, node policy labels and QoS annotations (docs/behaviour.md).

Every rejection carries a machine-readable ``reason`` (stable, CamelCase) and a
human ``message`` that says exactly what is wrong.
"""

from __future__ import annotations

import json
import re
from decimal import Decimal, InvalidOperation

import msgspec

from gpupool.events import Policy, QosConfig, Share
from gpupool.events.limits import (
    MAX_DURATION_MINUTES,
    MAX_NAMESPACE,
    MAX_NODE_NAME,
    MAX_POD_NAME,
    MAX_SECONDS_SETTING,
)

COMPUTE_CLASS_LABEL = "alibabacloud.com/compute-class"
COMPUTE_CLASS = "gpu-hpn"
POLICY_LABEL = "alibabacloud.com/gpu-share-policy"
QOS_ANNOTATION = "alibabacloud.com/gpu-share-qos-config"
CORE_RESOURCE = "alibabacloud.com/gpu-core.percentage"
MEMORY_RESOURCE = "alibabacloud.com/gpu-memory.percentage"
EXCLUSIVE_GPU_RESOURCE = "nvidia.com/gpu"
SHARE_RESOURCES = (CORE_RESOURCE, MEMORY_RESOURCE)
POD_POLICIES: tuple[Policy, ...] = ("share-pool", "static")
NODE_POLICIES = ("share-pool", "static", "none")


class Rejection(msgspec.Struct, frozen=True, kw_only=True):
    reason: str
    message: str


class ContainerResources(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    requests: dict[str, str | int] = {}
    limits: dict[str, str | int] = {}


class PodManifest(msgspec.Struct, frozen=True, kw_only=True):
    """The parts of a Kubernetes pod gpupool reads."""

    namespace: str
    name: str
    node: str
    uid: str = ""
    labels: dict[str, str] = {}
    priority: int = 0
    containers: tuple[ContainerResources, ...] = ()


class PodSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A validated GPU-sharing pod."""

    policy: Policy
    requests: Share
    limits: Share


def validate_pod(manifest: PodManifest) -> PodSpec | Rejection:
    compute_class = manifest.labels.get(COMPUTE_CLASS_LABEL)
    if compute_class != COMPUTE_CLASS:
        return Rejection(
            reason="UnsupportedComputeClass",
            message=f"label {COMPUTE_CLASS_LABEL} is {compute_class!r}; "
            f"only {COMPUTE_CLASS!r} is supported",
        )
    policy = manifest.labels.get(POLICY_LABEL)
    if policy not in POD_POLICIES:
        return Rejection(
            reason="InvalidSharePolicy",
            message=f"label {POLICY_LABEL} is {policy!r}; it must be 'share-pool' or 'static'",
        )
    sharing: list[ContainerResources] = []
    for container in manifest.containers:
        if not _asks_share(container):
            continue
        if _asks(container, EXCLUSIVE_GPU_RESOURCE):
            return Rejection(
                reason="MixedExclusiveAndShare",
                message=f"container {container.name!r} asks for both {EXCLUSIVE_GPU_RESOURCE} "
                "and GPU-share resources; use one or the other",
            )
        sharing.append(container)
    if not sharing:
        return Rejection(
            reason="NoGpuShareContainer",
            message=f"no container asks for {CORE_RESOURCE} and {MEMORY_RESOURCE}",
        )
    if len(sharing) > 1:
        names = ", ".join(repr(c.name) for c in sharing)
        return Rejection(
            reason="MultipleGpuShareContainers",
            message=f"only one container per pod may use GPU sharing; found {names}",
        )
    container = sharing[0]
    requests: dict[str, int] = {}
    limits: dict[str, int] = {}
    for kind, table, found in (
        ("requests", container.requests, requests),
        ("limits", container.limits, limits),
    ):
        for resource in SHARE_RESOURCES:
            if resource not in table:
                continue
            parsed = table[resource]
            if type(parsed) is not int or not 1 <= parsed <= 100:  # else _percentage's value
                parsed = _percentage(parsed)
            if isinstance(parsed, str):
                return Rejection(
                    reason="InvalidPercentage",
                    message=f"container {container.name!r} {kind}[{resource}] is "
                    f"{table[resource]!r}: {parsed}",
                )
            found[resource] = parsed
    for resource in SHARE_RESOURCES:
        if resource not in requests and resource not in limits:
            return Rejection(
                reason="MissingShareResource",
                message=f"container {container.name!r} must set {resource} "
                f"(both {CORE_RESOURCE} and {MEMORY_RESOURCE} are required)",
            )
        if resource not in requests:
            return Rejection(
                reason="MissingRequest",
                message=f"container {container.name!r} sets a limit but no request for {resource}",
            )
        request = requests[resource]
        limit = limits.setdefault(resource, request)
        if limit < request:
            return Rejection(
                reason="LimitBelowRequest",
                message=f"container {container.name!r} {resource}: limit {limit} is below "
                f"request {request}",
            )
    return PodSpec(
        policy=policy,
        requests=Share(core=requests[CORE_RESOURCE], memory=requests[MEMORY_RESOURCE]),
        limits=Share(core=limits[CORE_RESOURCE], memory=limits[MEMORY_RESOURCE]),
    )


def _asks(container: ContainerResources, resource: str) -> bool:
    return resource in container.requests or resource in container.limits


def _asks_share(container: ContainerResources) -> bool:
    """Whether it asks for any of ``SHARE_RESOURCES`` (spelt out: it runs per registration)."""
    requests, limits = container.requests, container.limits
    return (
        CORE_RESOURCE in requests
        or CORE_RESOURCE in limits
        or MEMORY_RESOURCE in requests
        or MEMORY_RESOURCE in limits
    )


def _percentage(value: str | int) -> int | str:
    """The integer percentage, or why it is not one."""
    if isinstance(value, bool):
        return "a percentage must be an integer from 1 to 100"
    if isinstance(value, str):
        if not re.fullmatch(r"[0-9]+", value.strip()):
            return "a percentage must be an integer from 1 to 100"
        value = int(value.strip())
    if value < 1:
        return "a percentage must be an integer from 1 to 100"
    if value > 100:
        return "shares are for one GPU: at most 100 (no aggregation across GPUs)"
    return value


# --------------------------------------------------------------------------- nodes


def validate_node_policy(label: str | None) -> Policy | Rejection | None:
    """The node label's policy; None for ``none`` or no label (disabled)."""
    if label is None or label == "none":
        return None
    if label in POD_POLICIES:
        return label
    return Rejection(
        reason="InvalidPolicy",
        message=f"label {POLICY_LABEL} is {label!r}; it must be one of share-pool, static, none",
    )


_QOS_KEYS: dict[str, tuple[str, type]] = {
    "preemptEnabled": ("preempt_enabled", bool),
    "podMaxDurationMinutes": ("pod_max_duration_minutes", int),
    "reservedEphemeralStorage": ("reserved_ephemeral_storage", str),
    "backfill": ("backfill", bool),
    "preemptGracePeriodSeconds": ("preempt_grace_seconds", int),
    "waitingMessagePeriodSeconds": ("waiting_message_period_seconds", int),
}


MAX_QOS_ANNOTATION = 4096
"""The longest QoS annotation read: its six keys fit in a tenth of it."""


def parse_qos_annotation(text: str | None) -> QosConfig | Rejection:
    """Parse ``alibabacloud.com/gpu-share-qos-config`` (missing: defaults, preemption off).

    Any text gives a QosConfig or a Rejection (never an exception): it is bounded in
    length (and so in nesting), and every number in range (docs/behaviour.md).
    """
    if text is None or not text.strip():
        return QosConfig()
    if len(text) > MAX_QOS_ANNOTATION:
        return _bad_qos(f"is {len(text)} characters long; at most {MAX_QOS_ANNOTATION} are read")
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        return _bad_qos(f"is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})")
    except RecursionError:
        return _bad_qos("nests JSON deeper than a QoS configuration can")
    if not isinstance(raw, dict):
        return _bad_qos(f"must be a JSON object, not {type(raw).__name__}")
    fields: dict[str, object] = {}
    for key, value in raw.items():
        if key not in _QOS_KEYS:
            known = ", ".join(_QOS_KEYS)
            return _bad_qos(f"has an unknown key {key!r} (known keys: {known})")
        name, kind = _QOS_KEYS[key]
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            return _bad_qos(f"{key} must be an integer, not {json.dumps(value)}")
        if kind is not int and not isinstance(value, kind):
            return _bad_qos(f"{key} must be a {kind.__name__}, not {json.dumps(value)}")
        fields[name] = value
    minutes = fields.get("pod_max_duration_minutes")
    if isinstance(minutes, int) and minutes < 1:
        return _bad_qos(f"podMaxDurationMinutes must be at least 1, not {minutes}")
    if isinstance(minutes, int) and minutes > MAX_DURATION_MINUTES:
        return _bad_qos(
            f"podMaxDurationMinutes must be at most {MAX_DURATION_MINUTES} (ten years), "
            f"not {minutes}"
        )
    grace = fields.get("preempt_grace_seconds")
    if isinstance(grace, int) and grace < 0:
        return _bad_qos(f"preemptGracePeriodSeconds must be 0 or more, not {grace}")
    period = fields.get("waiting_message_period_seconds")
    if isinstance(period, int) and period < 1:
        return _bad_qos(f"waitingMessagePeriodSeconds must be at least 1, not {period}")
    for key, seconds in (
        ("preemptGracePeriodSeconds", grace),
        ("waitingMessagePeriodSeconds", period),
    ):
        if isinstance(seconds, int) and seconds > MAX_SECONDS_SETTING:
            return _bad_qos(f"{key} must be at most {MAX_SECONDS_SETTING} (a day), not {seconds}")
    storage = fields.get("reserved_ephemeral_storage")
    if isinstance(storage, str):
        try:
            parse_quantity(storage)
        except ValueError as exc:
            return _bad_qos(f"reservedEphemeralStorage {exc}")
    try:
        return msgspec.convert(fields, QosConfig)
    except msgspec.ValidationError as exc:  # the checks above say why first; this is the net
        return _bad_qos(f"is out of range: {exc}")


_NODE_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?")
_VALID_NODE_NAMES: set[str] = set()


def validate_node_name(name: str) -> Rejection | None:
    """Why ``name`` cannot be a node gpupool manages (None: it can).

    A Kubernetes node name is a DNS subdomain (at most 253 letters, digits, ``-`` and
    ``.``); a name with a space, ``*``, ``>`` or ``_`` could not be a log subject token.
    The rejection is recorded on no node (the name cannot be one), with the name
    shortened in its message.
    """
    if name in _VALID_NODE_NAMES:
        return None
    if len(name) <= MAX_NODE_NAME and _NODE_NAME.fullmatch(name):
        if len(_VALID_NODE_NAMES) >= 4096:
            _VALID_NODE_NAMES.clear()
        _VALID_NODE_NAMES.add(name)  # a pure verdict, asked again for every pod of the node
        return None
    shown = repr(name[:64]) + (f" (and {len(name) - 64} more characters)" if len(name) > 64 else "")
    return Rejection(
        reason="InvalidNodeName",
        message=f"node name {shown} is not a Kubernetes node name: at most {MAX_NODE_NAME} "
        "letters, digits, '-' and '.', starting and ending with a letter or digit",
    )


def shortened_pod_ref(namespace: str, name: str) -> tuple[str, str]:
    """A namespace and name that fit the log's limits (a pod named longer is rejected)."""
    return namespace[:MAX_NAMESPACE], name[:MAX_POD_NAME]


def pod_name_problem(namespace: str, name: str, uid: str = "") -> str | None:
    if not (namespace.isascii() and name.isascii() and uid.isascii()):  # ASCII always encodes
        for what, text in (("namespace", namespace), ("pod name", name), ("pod uid", uid)):
            try:
                text.encode()
            except UnicodeEncodeError:
                return f"{what} {text[:64]!r} is not valid Unicode (it holds a lone surrogate)"
    if len(namespace) > MAX_NAMESPACE:
        return f"namespace of {len(namespace)} characters; at most {MAX_NAMESPACE}"
    if len(name) > MAX_POD_NAME:
        return f"pod name of {len(name)} characters; at most {MAX_POD_NAME}"
    return None


def _bad_qos(problem: str) -> Rejection:
    return Rejection(reason="InvalidQosConfig", message=f"annotation {QOS_ANNOTATION} {problem}")


_SUFFIXES = {
    "": Decimal(1),
    "k": Decimal(10) ** 3,
    "M": Decimal(10) ** 6,
    "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15,
    "E": Decimal(10) ** 18,
    "m": Decimal(1) / 1000,
    "Ki": Decimal(2) ** 10,
    "Mi": Decimal(2) ** 20,
    "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50,
    "Ei": Decimal(2) ** 60,
}
_QUANTITY = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?")


def parse_quantity(text: str) -> Decimal:
    """A Kubernetes resource quantity ("1.5Ti", "144", "500m") as a number of base units."""
    match = _QUANTITY.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not a Kubernetes quantity (e.g. 1.5Ti, 100Gi, 144)")
    try:
        number = Decimal(match.group(1))
    except InvalidOperation as exc:  # pragma: no cover - the regex admits only decimals
        raise ValueError(f"{text!r} is not a number") from exc
    return number * _SUFFIXES[match.group(2) or ""]


def format_quantity(value: Decimal, *, binary: bool = True) -> str:
    """The shortest exact Kubernetes spelling of ``value`` (binary suffixes for memory/storage)."""
    if value == 0:
        return "0"
    suffixes = ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki") if binary else ("E", "P", "T", "G", "M", "k")
    for suffix in suffixes:
        scaled = value / _SUFFIXES[suffix]
        if scaled == scaled.to_integral_value() and scaled >= 1:
            return f"{int(scaled)}{suffix}"
    if value == value.to_integral_value():
        return str(int(value))
    return f"{int(value * 1000)}m"
