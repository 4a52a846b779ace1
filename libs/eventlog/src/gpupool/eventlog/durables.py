"""The names of a service's durable consumers: a few fixed slots per NATS user, claimed by replicas.

NATS permissions match whole subject tokens, and a consumer's name is one token
of the JetStream API subjects (``$JS.API.CONSUMER.CREATE.<stream>.<name>.…``,
``….MSG.NEXT.<stream>.<name>``, ``$JS.ACK.<stream>.<name>.…``). So that each
service's credential may create, pull from and ack only its *own* durables, the
names are known when the credentials are made: ``<user>-0`` … ``<user>-7``, where
``<user>`` is the service's NATS user (``policy``, ``admission-queue``,
``preemption``, ``node-executor-<node>``; :func:`durable_base`).

A replica *claims* a slot: it takes the slot whose consumer names it (its
``--instance``) as claimant — the durable it had before a restart, resumed — or else
creates the first free slot with the JetStream ``create`` action, which the server
refuses if the consumer exists, so two replicas never share one. A slot whose
replica is gone frees itself: the server removes a consumer nobody pulled from
for :data:`SLOT_INACTIVE_SECONDS`. No credential may delete a consumer.
"""

from __future__ import annotations

from gpupool.eventlog.subjects import node_token

DURABLE_SLOTS = 8
"""Durables per NATS user: replicas running at once, plus those replaced within the
inactive threshold (a rollout, restarts under new names)."""

SLOT_INACTIVE_SECONDS = 300.0
"""A slot nobody pulls from for this long is removed by the server, and free again."""

CLAIMANT = "gpupool.claimant"
"""The consumer metadata key naming the replica that claimed the slot (its instance)."""


def durable_base(writer: str, node: str | None = None) -> str:
    """The NATS user of a writer service, the stem of its durables' names."""
    return writer if node is None else f"{writer}-{node_token(node)}"


def durable_names(base: str, *, slots: int = DURABLE_SLOTS) -> tuple[str, ...]:
    """The durable consumers a user may create and use: ``<base>-0`` … ``<base>-<slots-1>``."""
    return tuple(f"{base}-{slot}" for slot in range(slots))
