"""The one error of the read models, and how a pod is named on a command line."""

from __future__ import annotations

from gpupool.events import PodRef

DEFAULT_NAMESPACE = "default"


class AuditError(ValueError):
    """The question cannot be answered from this log (unknown pod or node, empty log)."""


def parse_pod(text: str) -> PodRef:
    """``NAMESPACE/NAME``, or ``NAME`` in the default namespace."""
    namespace, _, name = text.rpartition("/")
    if not name or "/" in namespace:
        raise AuditError(f"{text!r} is not a pod (NAMESPACE/NAME or NAME)")
    return PodRef(namespace=namespace or DEFAULT_NAMESPACE, name=name)
