"""The rejections the log already holds, so that the policy service records each once.

Every start of the policy service submits every node and pod of its cluster file
again (and the Kubernetes watches list everything again): an invalid pod or node
would be rejected again and the same PodRejected/NodeRejected appended on every
start. :class:`RecordedRejections` folds, from the log, which rejections are still
current (a pod's, until the pod registers or is removed; a node's, until the node is
configured or disabled), and :meth:`RecordedRejections.already_recorded` says when a
decision would only repeat them: the service then appends nothing and hands the
recorded rejection to its caller as if it were new (a Kubernetes Warning event is
still raised for it).
"""

from __future__ import annotations

from gpupool.events import (
    Envelope,
    Event,
    NodeConfigured,
    NodeDisabled,
    NodeRejected,
    PodRef,
    PodRegistered,
    PodRejected,
    PodRemoved,
)

RejectionKey = tuple[str, str, str, str]
"""(pod key or "", node, reason, message)."""


class RecordedRejections:
    def __init__(self) -> None:
        self._pods: dict[PodRef, set[RejectionKey]] = {}
        self._nodes: dict[str, set[RejectionKey]] = {}

    def observe(self, envelope: Envelope) -> None:
        """Fold one logged event (a projection observer calls it for every entry)."""
        event = envelope.event
        match event:
            case PodRejected():
                self._pods.setdefault(event.pod, set()).add(_key(event))
            case PodRegistered() | PodRemoved():
                self._pods.pop(event.pod, None)
            case NodeRejected():
                self._nodes.setdefault(event.node, set()).add(_key(event))
            case NodeConfigured() | NodeDisabled():
                self._nodes.pop(event.node, None)
            case _:
                pass

    def already_recorded(self, events: list[Event]) -> bool:
        """Whether ``events`` are rejections, every one of them already current in the log."""
        if not events:
            return False
        for event in events:
            if isinstance(event, PodRejected):
                if _key(event) not in self._pods.get(event.pod, ()):
                    return False
            elif isinstance(event, NodeRejected):
                if _key(event) not in self._nodes.get(event.node, ()):
                    return False
            else:
                return False
        return True


def _key(event: PodRejected | NodeRejected) -> RejectionKey:
    pod = event.pod.key if isinstance(event, PodRejected) else ""
    return (pod, event.node, event.reason, event.message)
