"""Preemptions, recorded on both pods as docs/behaviour.md shows.

For every ``Preempted`` event::

    victim     Warning  GPUSharePreempted  gpushare  GPU is preempted by <new-pod-name>.
    preemptor  Warning  GPUSharePreempt    gpushare  GPU is preempted from <old-pod-name>.

and on each pod, through the status subresource, the condition::

    type: Interruption.GPUShareReclaim
    status: "True"
    reason: GPUSharePreempted (victim) / GPUSharePreempt (preemptor)
    message: the event's text
    lastTransitionTime, lastProbeTime: the time of the Preempted event (RFC 3339, seconds, Z)

Event names derive from the log entry's id, so replaying the log records nothing twice.
"""

from __future__ import annotations

import logging
from datetime import datetime

from gpupool.events import Envelope, PodRef, Preempted
from gpupool.kube.pod_directory import PodDirectory
from gpupool.kube.port import KubernetesApi, KubernetesApiError
from gpupool.kube.records import PodCondition, PodEvent, kube_time, pod_event_name

log = logging.getLogger(__name__)

RECLAIM_CONDITION = "Interruption.GPUShareReclaim"
VICTIM_REASON = "GPUSharePreempted"
PREEMPTOR_REASON = "GPUSharePreempt"
EVENT_SOURCE = "gpushare"


def victim_message(preemptor: PodRef) -> str:
    return f"GPU is preempted by {preemptor.name}."


def preemptor_message(victim: PodRef) -> str:
    return f"GPU is preempted from {victim.name}."


class PreemptionRecorder:
    def __init__(self, api: KubernetesApi, pods: PodDirectory | None = None) -> None:
        self._api = api
        self._pods = pods

    async def on_envelope(self, envelope: Envelope) -> None:
        """Feed every logged event; only ``Preempted`` is recorded."""
        if isinstance(envelope.event, Preempted):
            await self.record(envelope.event, envelope.time, log_id=envelope.id)

    async def record(self, preempted: Preempted, time: datetime, *, log_id: str = "") -> None:
        stamp = kube_time(time)
        identity = log_id or f"{preempted.victim}>{preempted.preemptor}@{stamp}"
        for pod, reason, message in (
            (preempted.victim, VICTIM_REASON, victim_message(preempted.preemptor)),
            (preempted.preemptor, PREEMPTOR_REASON, preemptor_message(preempted.victim)),
        ):
            await self._api.create_event(
                PodEvent(
                    name=pod_event_name(pod.name, identity, reason),
                    pod=pod,
                    pod_uid=self._pods.uid_of(pod) if self._pods is not None else "",
                    type="Warning",
                    reason=reason,
                    message=message,
                    time=stamp,
                    source_component=EVENT_SOURCE,
                )
            )
            condition = PodCondition(
                type=RECLAIM_CONDITION,
                status="True",
                reason=reason,
                message=message,
                last_probe_time=stamp,
                last_transition_time=stamp,
            )
            try:
                await self._api.patch_pod_condition(pod.namespace, pod.name, condition)
            except KubernetesApiError as exc:
                if exc.status != 404:
                    raise
                log.info("pod %s is gone; condition %s not set", pod, RECLAIM_CONDITION)
