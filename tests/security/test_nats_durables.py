"""Each service's durable consumers are its own: on a real nats-server with the deployed config.

A service's credential may create, pull from and ack only its own durables
(``<user>-0`` … ``<user>-7``, :mod:`gpupool.eventlog.durables`), and no credential
may delete a consumer. Proved here with the generated credentials:

* another service's credential can neither delete a service's durable, nor pull from
  it, ack for it, read its info, nor create one of its slots first (by any of the
  JetStream API's create subjects) — and the victim goes on receiving every entry;
* a service's own credential cannot delete its durable either;
* a restarted replica resumes the durable it claimed (same ``--instance``), passing
  over what its rebuild folded, while a second replica claims another slot.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from test_nats_permissions import (
    ENVELOPES,
    NODES,
    STREAM,
    Deployment,
    Violations,
    client,
    deployed_stream_bounds,
    deployment,
    fresh,
    stream_exists,
)

from gpupool.eventlog.durables import CLAIMANT, durable_names
from gpupool.eventlog.jetstream import JetStreamEventLog, JetStreamSubscription
from gpupool.eventlog.port import Delivery
from gpupool.events import event_node

pytestmark = pytest.mark.integration

__all__ = ["deployed_stream_bounds", "deployment", "stream_exists"]  # fixtures used here

NODE = NODES[0]
API = "$JS.API"


async def service_log(deployment: Deployment, user: str, instance: str) -> JetStreamEventLog:
    return await JetStreamEventLog.connect(
        deployment.url,
        credentials=deployment.seed(user),
        tls_ca=deployment.ca,
        name=user,
        writer=user,
        claimant=instance,
        consumer_base=user,
    )


async def next_delivery(subscription: JetStreamSubscription) -> Delivery:
    async with asyncio.timeout(20):
        return await anext(subscription)


async def append_own(log: JetStreamEventLog) -> int:
    own = next(e for e in ENVELOPES if event_node(e.event) == NODE)
    return await log.append(fresh(own))


async def test_another_service_cannot_delete_consume_or_take_over_a_durable(
    deployment: Deployment, stream_exists: None
) -> None:
    del stream_exists
    victim = await service_log(deployment, "policy", "policy-replica-a")
    violations = Violations()
    attacker = await client(deployment, "preemption", violations)
    try:
        first = await append_own(victim)
        async with victim.subscribe(durable="policy", from_seq=first) as subscription:
            assert (await next_delivery(subscription)).entry.seq == first
            durable = subscription.durable
            assert durable == "policy-0"
            free_slot = "policy-1"
            forbidden = [
                f"{API}.CONSUMER.DELETE.{STREAM}.{durable}",
                f"{API}.CONSUMER.MSG.NEXT.{STREAM}.{durable}",
                f"{API}.CONSUMER.INFO.{STREAM}.{durable}",
                f"{API}.CONSUMER.PAUSE.{STREAM}.{durable}",
                f"{API}.CONSUMER.CREATE.{STREAM}.{durable}.gpupool.log.>",
                f"{API}.CONSUMER.CREATE.{STREAM}.{free_slot}",
                f"{API}.CONSUMER.CREATE.{STREAM}.{free_slot}.gpupool.log.>",
                f"{API}.CONSUMER.DURABLE.CREATE.{STREAM}.{free_slot}",
                f"$JS.ACK.{STREAM}.{durable}.1.{first}.1.0.0",
            ]
            for subject in forbidden:
                await attacker.publish(subject, b"{}", reply=attacker.new_inbox())
            assert await violations.wait_for(forbidden) == [], violations.seen
            # the nameless create (ordered consumers use it) would update any consumer it
            # names — the victim's filter, its inactivity threshold: refused to every user
            nameless = f"{API}.CONSUMER.CREATE.{STREAM}"
            update = {"name": durable, "filter_subject": "gpupool.log.nothing",
                      "ack_policy": "explicit", "inactive_threshold": 1_000_000_000}  # fmt: skip
            await attacker.publish(
                nameless,
                json.dumps({"stream_name": STREAM, "config": update}).encode(),
                reply=attacker.new_inbox(),
            )
            assert await violations.wait_for([nameless]) == [], violations.seen
            info = await victim._consumer_info(durable)
            assert info.config.filter_subject == "gpupool.log.>"
            assert info.config.metadata is not None
            assert info.config.metadata[CLAIMANT] == "policy-replica-a"
            # the service's own credential may not delete its durable either
            own = Violations()
            owner = await client(deployment, "policy", own)
            try:
                subject = f"{API}.CONSUMER.DELETE.{STREAM}.{durable}"
                await owner.publish(subject, b"", reply=owner.new_inbox())
                assert await own.wait_for([subject]) == [], own.seen
            finally:
                await owner.close()
            # the durable still delivers, and its free slot is still free for the service
            second = await append_own(victim)
            delivery = await next_delivery(subscription)
            await delivery.ack()
            assert delivery.entry.seq == second
        again = await service_log(deployment, "policy", "policy-replica-b")
        try:
            async with again.subscribe(durable="policy", from_seq=second) as other:
                assert (await next_delivery(other)).entry.seq == second
                assert other.durable == free_slot
        finally:
            await again.close()
    finally:
        await attacker.close()
        await victim.close()


async def test_a_restarted_replica_resumes_its_durable_and_another_claims_a_second(
    deployment: Deployment, stream_exists: None
) -> None:
    del stream_exists
    user = "admission-queue"
    log = await service_log(deployment, user, "aq-a")
    try:
        first = await append_own(log)
        async with log.subscribe(durable=user, from_seq=first) as subscription:
            delivery = await next_delivery(subscription)
            await delivery.ack()
            claimed = subscription.durable
    finally:
        await log.close()
    assert claimed in durable_names(user)
    # while aq-a is down: two more entries; its rebuild folds the first of them
    log = await service_log(deployment, user, "aq-b")
    try:
        second = await append_own(log)
        third = await append_own(log)
        async with log.subscribe(durable=user, from_seq=third) as other:
            assert (await next_delivery(other)).entry.seq == third
            assert other.durable != claimed  # a second replica, a slot of its own
    finally:
        await log.close()
    restarted = await service_log(deployment, user, "aq-a")
    try:
        # the durable acked `first`; the restarted replica folded up to `second`
        async with restarted.subscribe(durable=user, from_seq=second + 1) as resumed:
            delivery = await next_delivery(resumed)
            assert resumed.durable == claimed  # its own durable, resumed
            assert delivery.entry.seq == third  # `second` was passed over (folded before)
            await delivery.ack()
    finally:
        await restarted.close()
