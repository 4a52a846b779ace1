"""A node-executor with its deployed credential sets aside garbage on its node, once.

Real parts: the secure nats-server (TLS, nkeys, the generated permissions of
test_nats_permissions), the node-executor's own credential (it may publish on
``<prefix>.<its node>.node-executor`` only) and the policy service's. The executor records
its node's rejections on its node's subject; the whole-log services record theirs on the
node-less subject; each sees the other's and writes no second one.
"""

from __future__ import annotations

import asyncio

import test_nats_permissions as permissions
from test_nats_permissions import NODES, PREFIX, READER, Deployment

from gpupool.eventlog.credentials import NODE_EXECUTOR
from gpupool.eventlog.durables import durable_base
from gpupool.eventlog.jetstream import JetStreamEventLog
from gpupool.eventlog.port import StoredEvent
from gpupool.eventlog.reader import ReadOnlyLog
from gpupool.eventlog.subjects import node_entry_subject, node_of_subject
from gpupool.events import MessageRejected
from gpupool.runtime.decider import DeciderLoop

WAIT_S = 60.0

# the secure deployment's fixtures: one server per module, the stream made as deployed
deployed_stream_bounds = permissions.deployed_stream_bounds
deployment = permissions.deployment
stream_exists = permissions.stream_exists


async def connect_as(deployment: Deployment, writer: str, node: str | None) -> JetStreamEventLog:
    user = durable_base(writer, node)
    return await JetStreamEventLog.connect(
        deployment.url,
        credentials=deployment.seed(user),
        tls_ca=deployment.ca,
        writer=writer,
        name=user,
        consumer_base=user,  # as run_service connects: replays through the user's own consumers
    )


async def garbage_on(deployment: Deployment, node: str, data: bytes) -> int:
    policy = await connect_as(deployment, "policy", None)
    try:
        return await policy.append_raw(
            node_entry_subject(node, writer="policy", prefix=PREFIX), data
        )
    finally:
        await policy.close()


async def rejections_of(deployment: Deployment, seq: int) -> list[str]:
    """The subjects of every MessageRejected of entry ``seq`` in the log."""
    reader = await ReadOnlyLog.connect(
        deployment.url, credentials=deployment.seed(READER), tls_ca=deployment.ca
    )
    try:
        last = await reader.last_seq()
        return [
            entry.subject
            async for entry in reader.entries(until_seq=last)
            if isinstance(entry, StoredEvent)
            and isinstance(entry.envelope.event, MessageRejected)
            and entry.envelope.event.seq == seq
        ]
    finally:
        await reader.close()


async def test_the_executor_records_its_nodes_garbage_on_its_nodes_subject_once(
    deployment: Deployment, stream_exists: None
) -> None:
    node = NODES[0]
    seq = await garbage_on(deployment, node, b"{not json")
    for _ in range(2):  # a second executor (a restart from zero) finds it recorded
        log = await connect_as(deployment, NODE_EXECUTOR, node)
        try:
            loop = DeciderLoop(log, service=NODE_EXECUTOR, partition=node)
            async with asyncio.timeout(WAIT_S):
                await loop.rebuild()
            assert seq in loop.projection.state.rejected_sequences
        finally:
            await log.close()
    policy = await connect_as(deployment, "policy", None)
    try:  # a whole-log service folds the executor's rejection and writes none of its own
        loop = DeciderLoop(policy, service="policy")
        async with asyncio.timeout(WAIT_S):
            await loop.rebuild()
        assert seq in loop.projection.state.rejected_sequences
    finally:
        await policy.close()
    subjects = await rejections_of(deployment, seq)
    assert len(subjects) == 1
    assert node_of_subject(subjects[0]) == node


async def test_the_executor_writes_none_where_a_whole_log_service_recorded_one(
    deployment: Deployment, stream_exists: None
) -> None:
    node = NODES[0]
    seq = await garbage_on(deployment, node, b"\x00 not an envelope either")
    policy = await connect_as(deployment, "policy", None)
    try:
        async with asyncio.timeout(WAIT_S):
            await DeciderLoop(policy, service="policy").rebuild()
    finally:
        await policy.close()
    log = await connect_as(deployment, NODE_EXECUTOR, node)
    try:
        loop = DeciderLoop(log, service=NODE_EXECUTOR, partition=node)
        async with asyncio.timeout(WAIT_S):
            await loop.rebuild()
        assert seq in loop._nodeless_rejections
    finally:
        await log.close()
    subjects = await rejections_of(deployment, seq)
    assert len(subjects) == 1
    assert node_of_subject(subjects[0]) is None  # the policy service's, node-less
