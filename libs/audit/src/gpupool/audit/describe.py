"""Short human texts for the facts of the log (shares, QoS, one event): shared by the CLI and
the console, so that both say the same thing the same way. Strings only; nothing is printed."""

from __future__ import annotations

from datetime import timedelta

from gpupool.audit.history import PodStep, QueueCause
from gpupool.audit.times import format_duration
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


def cause_text(cause: QueueCause) -> str:
    match cause.what:
        case "assigned":
            return f"{cause.pod} left the queue (assigned GPU {cause.gpu_index})"
        case "joined":
            return f"{cause.pod} joined the queue"
        case "left":
            return f"{cause.pod} left the queue ({cause.reason})"
        case "removed":
            return f"{cause.pod} was removed"
    return f"{cause.what} {cause.pod or ''}".rstrip()


def _after(verb: str, duration: timedelta | None) -> str:
    return f" after {verb} {format_duration(duration)}" if duration is not None else ""


def step_text(step: PodStep) -> str:
    """One step in words."""
    match step.kind:
        case "registered":
            assert step.requests is not None and step.limits is not None
            return (
                f"registered on {step.node}: {step.policy}, requests "
                f"{share_text(step.requests)}, limits {share_text(step.limits)}, "
                f"priority {step.priority}"
            )
        case "rejected":
            return f"rejected, {step.reason}: {step.message}"
        case "ready":
            return f"ready: joins the queue at position {step.position} of {step.queue_length}"
        case "moved":
            assert step.cause is not None
            return (
                f"position {step.position} of {step.queue_length} (was {step.was}): "
                f"{cause_text(step.cause)}"
            )
        case "bound":
            return f"bound to GPU {step.gpu_index} ({step.gpu_uuid}) at admission (static)"
        case "assigned":
            where = ", ".join(str(p) for p in step.positions)
            plural = "s" if len(step.positions) > 1 else ""
            return (
                f"assigned GPU {step.gpu_index} ({step.gpu_uuid}) after waiting "
                f"{format_duration(step.waited) if step.waited is not None else '?'} "
                f"at position{plural} {where}"
            )
        case "preempted":
            return (
                f"preempted by {step.other} on GPU {step.gpu_index} "
                f"(reason {step.reason}){_after('holding it', step.held)}"
            )
        case "preempts":
            return f"preempts {step.other} on GPU {step.gpu_index} (reason {step.reason})"
        case "left-queue":
            return f"left the queue: {step.reason}{_after('waiting', step.waited)}"
        case "released":
            exit_code = "" if step.exit_code is None else f" (exit code {step.exit_code})"
            return (
                f"released GPU {step.gpu_index}: {step.reason}{exit_code}"
                f"{_after('holding it', step.held)}"
            )
        case "removed":
            was = (
                f" (it was {step.phase_before})"
                if step.phase_before and step.phase_before != "dormant"
                else ""
            )
            return f"removed: the pod was deleted{was}"
