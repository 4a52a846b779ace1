"""Short human texts for the facts of the log (shares, QoS, one event): shared by the CLI and
the console, so that both say the same thing the same way. Strings only; nothing is printed."""

from __future__ import annotations

from gpupool.events import (
    Assigned,
    Event,
    GpuInventoryReported,
    MessageRejected,
    NodeConfigured,
    NodeDisabled,
    NodeRejected,
    PodReady,
    PodRef,
    PodRegistered,
    PodRejected,
    PodRemoved,
    Preempted,
    QosConfig,
    Released,
    Share,
)


def share_text(share: Share) -> str:
    return f"core {share.core}% memory {share.memory}%"


def qos_text(qos: QosConfig) -> str:
    if qos.preempt_enabled:
        limit = (
            f"podMaxDurationMinutes {qos.pod_max_duration_minutes}"
            if qos.pod_max_duration_minutes is not None
            else "no podMaxDurationMinutes"
        )
        preemption = f"preemption on ({limit}, grace {qos.preempt_grace_seconds}s)"
    else:
        preemption = "preemption off"
    return f"{preemption}, backfill {'on' if qos.backfill else 'off'}"


def event_pod_column(event: Event) -> str:
    """The pod a log line is about (the victim, for Preempted), or empty."""
    if isinstance(event, Preempted):
        return str(event.victim)
    pod = getattr(event, "pod", None)
    return str(pod) if isinstance(pod, PodRef) else ""


def event_details(event: Event) -> str:
    """One line saying what the event records."""
    match event:
        case NodeConfigured():
            gpus = f", {event.gpu_count} GPUs" if event.gpu_count else ""
            return f"policy {event.policy}{gpus}, {qos_text(event.qos)}"
        case NodeDisabled():
            return "GPU sharing disabled (policy none)"
        case NodeRejected() | PodRejected():
            return f"{event.reason}: {event.message}"
        case GpuInventoryReported():
            indexes = ", ".join(str(gpu.index) for gpu in event.gpus)
            return f"{len(event.gpus)} GPUs ({event.source}): {indexes}"
        case PodRegistered():
            return (
                f"{event.policy}, requests {share_text(event.requests)}, "
                f"limits {share_text(event.limits)}, priority {event.priority}"
            )
        case PodReady():
            return "joins the ready queue"
        case Assigned():
            return f"GPU {event.gpu_index} ({event.gpu_uuid})"
        case Preempted():
            return f"for {event.preemptor} on GPU {event.gpu_index}, reason {event.reason}"
        case Released():
            exit_code = "" if event.exit_code is None else f", exit code {event.exit_code}"
            where = "left the ready queue" if event.gpu_index is None else f"GPU {event.gpu_index}"
            return f"{event.reason}, {where}{exit_code}"
        case PodRemoved():
            return "deleted"
        case MessageRejected():
            return f"{event.subject}: {event.reason}"
