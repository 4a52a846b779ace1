"""Every client of the node-executor is told its true outcome, and only its owner may ask.

Real parts: the node-executor service object on a real Unix socket, real ``gpupool run``
clients (``run_workload``), real commands, the in-memory log with the other services'
deciders driven by the test. Findings of issue 12: a reattaching client was told
``NothingToReattach`` when its outcome was only in the log; a pod preempted before its command
started raised AttributeError; a graceful stop closed clients before their last word; a
failure of the service killed the running jobs; any user could act for any pod.
"""

from __future__ import annotations

import asyncio
import os
import select
import shutil
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, suppress
from datetime import UTC, datetime, timedelta
from pathlib import Path

import msgspec
import pytest

from gpupool.core import Schedule
from gpupool.eventlog import InMemoryEventLog
from gpupool.eventlog.port import StoredEvent
from gpupool.events import (
    Assigned,
    Envelope,
    Event,
    GpuInventoryReported,
    MessageRejected,
    NodeConfigured,
    PodReady,
    PodRef,
    PodRegistered,
    PodRejected,
    Preempted,
    QosConfig,
    Released,
    Share,
)
from gpupool.gpus import simulated_inventory
from gpupool.node_executor.inventory import sampler_for
from gpupool.node_executor.peer_identity import IdentityMode
from gpupool.node_executor.pod_owners import PodOwners
from gpupool.node_executor.processes import ProcessSupervisor, WorkloadRecord, group_members
from gpupool.node_executor.service import NodeExecutor
from gpupool.runtime.decider import DeciderLoop
from gpupool.workload import (
    EXIT_EXECUTOR_UNAVAILABLE,
    EXIT_PREEMPTED,
    ExecutorMessage,
    Exited,
    Rejected,
    RunRequest,
    Started,
    decode_executor_message,
    encode_line,
    run_workload,
)
from gpupool.workload import Preempted as PreemptedNotice

pytestmark = pytest.mark.integration

NODE = "n1"
A = PodRef(namespace="default", name="a")
B = PodRef(namespace="default", name="b")
TIMEOUT = 15.0
INVENTORY = simulated_inventory(1, node=NODE)


def registered(ref: PodRef, *, share: int = 100) -> PodRegistered:
    return PodRegistered(
        pod=ref,
        node=NODE,
        policy="share-pool",
        requests=Share(core=share, memory=share),
        limits=Share(core=share, memory=share),
        uid=f"uid-{ref.name}",
    )


NODE_EVENTS: list[Event] = [
    GpuInventoryReported(node=NODE, gpus=INVENTORY.gpus, source="simulated"),
    NodeConfigured(node=NODE, policy="share-pool", qos=QosConfig(), gpu_count=1),
    registered(A),
    registered(B),
]


@pytest.fixture
def devnull() -> Iterator[int]:
    fd = os.open(os.devnull, os.O_RDWR)
    yield fd
    os.close(fd)


class Inbox:
    def __init__(self) -> None:
        self.messages: list[ExecutorMessage] = []
        self.changed = asyncio.Event()

    def __call__(self, message: ExecutorMessage) -> None:
        self.messages.append(message)
        self.changed.set()

    async def until(self, kind: type) -> ExecutorMessage:
        async with asyncio.timeout(TIMEOUT):
            while True:
                found = next((m for m in self.messages if isinstance(m, kind)), None)
                if found is not None:
                    return found
                self.changed.clear()
                await self.changed.wait()


async def append(log: InMemoryEventLog, event: Event, *, at: datetime | None = None) -> None:
    envelope = Envelope(id=uuid.uuid4().hex, time=at or datetime.now(UTC), event=event)
    await log.append(envelope)


@asynccontextmanager
async def executor_on(
    log: InMemoryEventLog,
    tmp_path: Path,
    *,
    pod_owners: PodOwners | None = None,
    fail_on_exit: bool = False,
    socket_path: Path | None = None,
    identity: IdentityMode = "request",
) -> AsyncIterator[NodeExecutor]:
    """A node-executor serving on ``tmp_path``/gpupool.sock until the block ends.

    ``fail_on_exit``: the block ends as a failing service does (an exception through its stack).
    """
    loop = DeciderLoop(log, service="node-executor")
    await loop.rebuild()
    executor = NodeExecutor(
        node=NODE,
        inventory=INVENTORY,
        socket_path=socket_path or tmp_path / "gpupool.sock",
        sampler=sampler_for(INVENTORY),
        supervisor=ProcessSupervisor(records_dir=tmp_path / "state" / "workloads"),
        message_period_seconds=3600,
        reattach_seconds=5,
        pod_owners=pod_owners,
        identity=identity,
    )
    with suppress(ConsumerFailed):
        async with AsyncExitStack() as stack:
            await executor.start(loop, stack)
            consumer = asyncio.create_task(loop.consume(f"executor-{uuid.uuid4()}", executor.react))

            async def stop_consumer() -> None:
                consumer.cancel()
                with suppress(asyncio.CancelledError):
                    await consumer

            stack.push_async_callback(stop_consumer)
            yield executor
            if fail_on_exit:
                raise ConsumerFailed("consumer_info timed out")


class ConsumerFailed(Exception):
    """Stands for the NATS timeout that used to end the service with its jobs."""


async def decider(log: InMemoryEventLog, service: str) -> DeciderLoop:
    loop = DeciderLoop(log, service=service)
    await loop.rebuild()
    return loop


async def until_logged(log: InMemoryEventLog, kind: type, pod: PodRef) -> None:
    """Returns once the log holds a ``kind`` event of ``pod`` (from the start of the log)."""
    async with asyncio.timeout(TIMEOUT):
        async with log.subscribe(durable=f"test-{uuid.uuid4()}") as deliveries:
            async for delivery in deliveries:
                await delivery.ack()
                for entry in delivery.entries:
                    if (
                        isinstance(entry, StoredEvent)
                        and isinstance(entry.envelope.event, kind)
                        and getattr(entry.envelope.event, "pod", None) == pod
                    ):
                        return


def reattaching(ref: PodRef, argv: list[str], sent_at: float) -> RunRequest:
    return RunRequest(pod=ref, argv=argv, cwd="/", env={}, reattach=True, sent_at=sent_at)


# --------------------------------------------------------------------------- outcomes


@pytest.mark.parametrize(
    ("reason", "code", "exit_code"),
    [("completed", 0, 0), ("failed", 3, 3), ("preempted", 143, EXIT_PREEMPTED)],
)
async def test_a_client_reattaching_after_restarts_is_told_the_outcome_the_log_holds(
    tmp_path: Path, devnull: int, reason: str, code: int, exit_code: int
) -> None:
    """The run ended (Released in the log) while no executor that knew it was alive."""
    log = InMemoryEventLog()
    sent = datetime.now(UTC) - timedelta(seconds=30)
    for event in NODE_EVENTS:
        await append(log, event, at=sent - timedelta(seconds=60))
    await append(log, PodReady(pod=A, node=NODE), at=sent + timedelta(seconds=1))
    gpu = INVENTORY.gpus[0]
    await append(
        log,
        Assigned(pod=A, node=NODE, gpu_index=gpu.index, gpu_uuid=gpu.uuid),
        at=sent + timedelta(seconds=2),
    )
    if reason == "preempted":  # a preemption's release follows its Preempted
        await append(log, PodReady(pod=B, node=NODE), at=sent + timedelta(seconds=10))
        await append(
            log,
            Preempted(
                victim=A,
                preemptor=B,
                node=NODE,
                gpu_index=gpu.index,
                gpu_uuid=gpu.uuid,
                reason="priority",
            ),
            at=sent + timedelta(seconds=11),
        )
    await append(
        log,
        Released(pod=A, node=NODE, reason=reason, exit_code=code, gpu_index=0),  # type: ignore[arg-type]
        at=sent + timedelta(seconds=20),
    )
    inbox = Inbox()
    async with executor_on(log, tmp_path):
        result = await run_workload(
            tmp_path / "gpupool.sock",
            reattaching(A, ["true"], sent.timestamp()),
            on_message=inbox,
            fds=(devnull, devnull, devnull),
        )
    assert inbox.messages == [Exited(exit_code=code, reason=reason)]  # type: ignore[arg-type]
    assert result == exit_code


async def test_an_earlier_runs_release_is_not_taken_for_this_runs_outcome(
    tmp_path: Path, devnull: int
) -> None:
    """Released before the client first sent its request, no PodReady since: the executor never
    acted on the request, so nothing ran, and it is served now (once)."""
    log = InMemoryEventLog()
    earlier = datetime.now(UTC) - timedelta(seconds=120)
    for event in NODE_EVENTS:
        await append(log, event, at=earlier)
    await append(log, Released(pod=A, node=NODE, reason="completed", exit_code=0), at=earlier)
    inbox = Inbox()
    marker = tmp_path / "ran"
    async with executor_on(log, tmp_path):
        client = asyncio.create_task(
            run_workload(
                tmp_path / "gpupool.sock",
                reattaching(
                    A,
                    [sys.executable, "-c", f"open({str(marker)!r}, 'a').write('x')"],
                    time.time() - 5,
                ),
                on_message=inbox,
                fds=(devnull, devnull, devnull),
            )
        )
        await until_logged(log, PodReady, A)
        admission = await decider(log, "admission-queue")
        await admission.execute(Schedule(node=NODE), node=NODE)
        async with asyncio.timeout(TIMEOUT):
            assert await client == 0
    assert isinstance(inbox.messages[0], Started)
    assert inbox.messages[-1] == Exited(exit_code=0, reason="completed")
    assert marker.read_text() == "x"  # it ran once


async def test_a_pod_preempted_before_its_command_starts_is_told_so(
    tmp_path: Path, devnull: int
) -> None:
    """Assigned and Preempted folded together: the fold has cleared evicted_by by the time the
    release is recorded (AttributeError, told as an internal error, before the fix)."""
    log = InMemoryEventLog()
    for event in NODE_EVENTS:
        await append(log, event)
    inbox = Inbox()
    async with executor_on(log, tmp_path):
        client = asyncio.create_task(
            run_workload(
                tmp_path / "gpupool.sock",
                RunRequest(pod=A, argv=["true"], cwd="/", env={}),
                on_message=inbox,
                fds=(devnull, devnull, devnull),
            )
        )
        await until_logged(log, PodReady, A)
        admission = await decider(log, "admission-queue")
        # no await between the two yields to the executor: it folds them as one change
        await admission.execute(Schedule(node=NODE), node=NODE)
        await append(
            log,
            Preempted(
                victim=A,
                preemptor=B,
                node=NODE,
                gpu_index=0,
                gpu_uuid=INVENTORY.gpus[0].uuid,
                reason="priority",
            ),
        )
        async with asyncio.timeout(TIMEOUT):
            result = await client
    assert inbox.messages[-2:] == [
        PreemptedNotice(by="b", gpu_index=0),
        Exited(exit_code=0, reason="preempted"),
    ], inbox.messages
    assert result == EXIT_PREEMPTED


# --------------------------------------------------------------------------- stopping


HOLD = "import sys, time; print('up', flush=True); time.sleep(60)"


async def test_a_graceful_stop_tells_every_client_its_last_word(
    tmp_path: Path, devnull: int
) -> None:
    log = InMemoryEventLog()
    for event in NODE_EVENTS:
        await append(log, event)
    running, waiting = Inbox(), Inbox()
    async with executor_on(log, tmp_path):
        socket_path = tmp_path / "gpupool.sock"
        first = asyncio.create_task(
            run_workload(
                socket_path,
                RunRequest(pod=A, argv=[sys.executable, "-c", HOLD], cwd="/", env={}),
                on_message=running,
                fds=(devnull, devnull, devnull),
            )
        )
        await until_logged(log, PodReady, A)
        admission = await decider(log, "admission-queue")
        await admission.execute(Schedule(node=NODE), node=NODE)
        await running.until(Started)
        second = asyncio.create_task(
            run_workload(
                socket_path,
                RunRequest(pod=B, argv=["true"], cwd="/", env={}),
                on_message=waiting,
                fds=(devnull, devnull, devnull),
            )
        )
        await until_logged(log, PodReady, B)
    # the block's end is the graceful stop; the clients were told before their connection closed
    async with asyncio.timeout(TIMEOUT):
        assert await first == EXIT_EXECUTOR_UNAVAILABLE
        assert await second == EXIT_EXECUTOR_UNAVAILABLE
    assert isinstance(running.messages[-1], Exited)
    assert running.messages[-1].reason == "cancelled"
    assert waiting.messages[-1] == Exited(exit_code=0, reason="cancelled")


async def test_a_failing_executor_leaves_the_running_job_for_the_next_one(
    tmp_path: Path, devnull: int
) -> None:
    """An exception through the service's stack (a NATS timeout) is not a stop: like a SIGKILL,
    the command runs on, the client is not told a false end, the next executor adopts it."""
    log = InMemoryEventLog()
    for event in NODE_EVENTS:
        await append(log, event)
    inbox = Inbox()
    release = tmp_path / "release"
    job = (
        "import os, sys, time\n"
        f"while not os.path.exists({str(release)!r}): time.sleep(0.05)\n"
        "sys.exit(5)\n"
    )
    async with executor_on(log, tmp_path, fail_on_exit=True):
        client = asyncio.create_task(
            run_workload(
                tmp_path / "gpupool.sock",
                RunRequest(pod=A, argv=[sys.executable, "-c", job], cwd="/", env={}),
                on_message=inbox,
                fds=(devnull, devnull, devnull),
                reconnect_seconds=TIMEOUT,
            )
        )
        await until_logged(log, PodReady, A)
        admission = await decider(log, "admission-queue")
        await admission.execute(Schedule(node=NODE), node=NODE)
        started = await inbox.until(Started)
        assert isinstance(started, Started)
    assert group_members(started.pid), "the failing executor ended the job"
    assert not client.done()  # not told a false end: it is reconnecting
    release.touch()
    async with executor_on(log, tmp_path):
        async with asyncio.timeout(TIMEOUT):
            assert await client == 5
    assert inbox.messages[-1] == Exited(exit_code=5, reason="failed")
    assert [m for m in inbox.messages if isinstance(m, Rejected)] == []


async def test_the_first_connect_waits_for_an_executor_that_is_starting(
    tmp_path: Path, devnull: int
) -> None:
    log = InMemoryEventLog()
    for event in NODE_EVENTS:
        await append(log, event)
    inbox = Inbox()
    retrying = asyncio.Event()
    client = asyncio.create_task(
        run_workload(
            tmp_path / "gpupool.sock",
            RunRequest(pod=A, argv=["true"], cwd="/", env={}),
            on_message=inbox,
            fds=(devnull, devnull, devnull),
            reconnect_seconds=TIMEOUT,
            on_retry=lambda text: retrying.set(),
        )
    )
    async with asyncio.timeout(TIMEOUT):
        await retrying.wait()  # it found no executor and keeps trying
    assert not client.done()
    async with executor_on(log, tmp_path):
        await until_logged(log, PodReady, A)
        admission = await decider(log, "admission-queue")
        await admission.execute(Schedule(node=NODE), node=NODE)
        async with asyncio.timeout(TIMEOUT):
            assert await client == 0


# --------------------------------------------------------------------------- owners


def cluster_file(path: Path, owner_of_a: int | None) -> Path:
    owner = f", owner_uid: {owner_of_a}" if owner_of_a is not None else ""
    path.write_text(
        "nodes: [{name: n1, gpus: 1}]\n"
        f"pods:\n  - {{name: a, node: n1{owner}}}\n  - {{name: b, node: n1}}\n"
    )
    return path


OTHER_UID = 4242


async def run_as_other_user(socket_path: Path, pod: PodRef) -> list[ExecutorMessage]:
    """A real process of another user (uid 4242, in the socket's group) asks for ``pod``.

    Forked from this process (so nothing needs to be executable by that user); it sends a
    RunRequest with its stdio and writes back the lines it was answered.
    """
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child process
        try:
            os.close(read_end)
            os.setgroups([os.getgid()])
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(TIMEOUT)
                sock.connect(str(socket_path))
                request = RunRequest(pod=pod, argv=["true"], cwd="/", env={}, sent_at=time.time())
                socket.send_fds(sock, [encode_line(request)], [0, 1, 2])
                with sock.makefile("rb") as replies:
                    for line in replies:
                        os.write(write_end, line)
                        if decode_executor_message(line).__class__ in (Exited, Rejected):
                            break
        except BaseException as error:
            os.write(write_end, f"child failed: {error!r}\n".encode())
        finally:
            os._exit(0)
    os.close(write_end)
    loop = asyncio.get_running_loop()
    with os.fdopen(read_end, "rb") as replies:
        data = await loop.run_in_executor(None, replies.read)
    await loop.run_in_executor(None, os.waitpid, child, 0)
    assert not data.startswith(b"child failed"), data
    return [decode_executor_message(line) for line in data.splitlines(keepends=True)]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")
async def test_another_member_of_the_sockets_group_cannot_act_for_a_pod_it_does_not_own(
    tmp_path: Path,
) -> None:
    reachable = Path(tempfile.mkdtemp(prefix="gpupool-owners-"))  # tmp_path is root's only
    reachable.chmod(0o755)
    socket_path = reachable / "gpupool.sock"
    log = InMemoryEventLog()
    for event in NODE_EVENTS:
        await append(log, event)
    owners = PodOwners(cluster_file(tmp_path / "cluster.yaml", OTHER_UID), executor_uid=1)
    try:
        async with executor_on(
            log, tmp_path, pod_owners=owners, socket_path=socket_path
        ) as executor:
            told_b = await run_as_other_user(socket_path, B)
            asking_a = asyncio.create_task(run_as_other_user(socket_path, A))
            await until_logged(log, PodReady, A)  # its own pod is queued for it
            admission = await decider(log, "admission-queue")
            await admission.execute(Schedule(node=NODE), node=NODE)
            async with asyncio.timeout(TIMEOUT):
                told_a = await asking_a
            assert executor.socket_server is not None
            await executor.socket_server.refusals.close()
    finally:
        shutil.rmtree(reachable, ignore_errors=True)
    file_owner = os.stat(tmp_path / "cluster.yaml").st_uid
    assert told_b == [
        Rejected(
            reason="NotPodOwner",
            message=f"uid {OTHER_UID} may not act for pod default/b: it belongs to uid {file_owner}",
        )
    ]
    # its own pod was queued and assigned for it (PodReady above); what it is told last is
    # about its command, not its right to it (here, as uid 4242, this test's interpreter
    # cannot even be executed: StartFailed)
    assert told_a and all(getattr(m, "reason", "") != "NotPodOwner" for m in told_a), told_a
    refusals = [
        e.envelope.event
        for e in [entry async for entry in log.replay()]
        if isinstance(e, StoredEvent) and isinstance(e.envelope.event, MessageRejected)
    ]
    assert [r.reason.split(":")[0] for r in refusals] == ["NotPodOwner"]
    assert f"uid {OTHER_UID}" in refusals[0].reason
    # nothing was asked for b
    assert not [
        e
        for e in [entry async for entry in log.replay()]
        if isinstance(e, StoredEvent)
        and isinstance(e.envelope.event, PodReady)
        and e.envelope.event.pod == B
    ]


def test_pod_owners_come_from_the_cluster_file(tmp_path: Path) -> None:
    path = cluster_file(tmp_path / "cluster.yaml", 1000)
    owners = PodOwners(path, executor_uid=77)
    file_owner = os.stat(path).st_uid
    assert owners.owner_of(A) == 1000
    assert owners.owner_of(B) == file_owner  # no owner_uid: whoever owns the file
    assert owners.authorise(1000, A) is None
    assert owners.authorise(77, A) is None  # the executor's own user
    assert owners.authorise(0, A) is None  # root
    refused = owners.authorise(1001, A)
    assert refused is not None and refused.reason == "NotPodOwner"
    assert refused.message == "uid 1001 may not act for pod default/a: it belongs to uid 1000"
    unknown = owners.authorise(1001, PodRef(namespace="x", name="y"))
    assert unknown is not None and "declares no pod x/y" in unknown.message
    # a change to the file is seen at the next question
    cluster_file(path, 1001)
    assert owners.authorise(1001, A) is None
    # without a cluster file, only root and the executor's user
    nobody = PodOwners(None, executor_uid=77)
    assert nobody.authorise(77, A) is None
    refused = nobody.authorise(1000, A)
    assert refused is not None and "no cluster file" in refused.message


async def test_a_command_that_finished_as_the_executor_stops_is_recorded_as_finished(
    tmp_path: Path, devnull: int
) -> None:
    """The command exited (code 0) but its session had not yet seen it when the graceful stop
    came: its end is `completed`, not `cancelled` (8 finished commands were recorded wrongly)."""
    log = InMemoryEventLog()
    for event in NODE_EVENTS:
        await append(log, event)
    inbox = Inbox()
    go = tmp_path / "go"
    job = f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.02)\n"
    async with executor_on(log, tmp_path):
        client = asyncio.create_task(
            run_workload(
                tmp_path / "gpupool.sock",
                RunRequest(pod=A, argv=[sys.executable, "-c", job], cwd="/", env={}),
                on_message=inbox,
                fds=(devnull, devnull, devnull),
            )
        )
        await until_logged(log, PodReady, A)
        admission = await decider(log, "admission-queue")
        await admission.execute(Schedule(node=NODE), node=NODE)
        started = await inbox.until(Started)
        assert isinstance(started, Started)
        pidfd = os.pidfd_open(started.pid)
        go.touch()
        # block the event loop until the command is gone, so its session cannot see it first
        select.select([pidfd], [], [], TIMEOUT)
        os.close(pidfd)
    async with asyncio.timeout(TIMEOUT):
        assert await client == 0
    assert inbox.messages[-1] == Exited(exit_code=0, reason="completed")
    releases = [
        e.envelope.event
        for e in [entry async for entry in log.replay()]
        if isinstance(e, StoredEvent) and isinstance(e.envelope.event, Released)
    ]
    assert [(r.reason, r.exit_code) for r in releases] == [("completed", 0)]


async def test_a_pod_assigned_before_the_executor_died_runs_when_its_client_reattaches(
    tmp_path: Path, devnull: int
) -> None:
    """Assigned in the log, but no record of a command: it never started (every command is
    recorded before it starts). The restarted executor keeps the GPU for the client and runs
    the command once it reattaches, instead of recording a failure nobody had."""
    log = InMemoryEventLog()
    sent = datetime.now(UTC) - timedelta(seconds=5)
    for event in NODE_EVENTS:
        await append(log, event, at=sent - timedelta(seconds=60))
    await append(log, PodReady(pod=A, node=NODE), at=sent + timedelta(seconds=1))
    admission = await decider(log, "admission-queue")
    await admission.execute(Schedule(node=NODE), node=NODE)
    inbox = Inbox()
    async with executor_on(log, tmp_path):
        code = await run_workload(
            tmp_path / "gpupool.sock",
            reattaching(A, [sys.executable, "-c", "raise SystemExit(4)"], sent.timestamp()),
            on_message=inbox,
            fds=(devnull, devnull, devnull),
        )
    assert code == 4
    assert isinstance(inbox.messages[0], Started)
    assert inbox.messages[-1] == Exited(exit_code=4, reason="failed")
    releases = [
        (e.envelope.event.reason, e.envelope.event.exit_code)
        for e in [entry async for entry in log.replay()]
        if isinstance(e, StoredEvent) and isinstance(e.envelope.event, Released)
    ]
    assert releases == [("failed", 4)]


def test_a_command_recorded_as_starting_is_resolved_by_its_shim_or_status(tmp_path: Path) -> None:
    records = tmp_path / "workloads"
    supervisor = ProcessSupervisor(records_dir=records)
    for name, status in (("never", None), ("ended", "3\n")):
        pod = PodRef(namespace="default", name=name)
        record, status_file = supervisor._paths(pod)
        if status is not None:
            status_file.write_text(status)
        record.write_bytes(
            msgspec.json.encode(
                WorkloadRecord(pod=pod, pid=0, start_ticks=0, status_file=str(status_file))
            )
        )
    adopted = supervisor.adopt()
    assert [(w.pod.name, w.pid) for w in adopted] == [("ended", -1)]
    assert not (records / "default.never.json").exists()  # it never started: forgotten


async def test_a_flood_of_refused_callers_costs_a_few_events_and_one_summary(
    tmp_path: Path, devnull: int
) -> None:
    """Kernel mode, a caller in no pod, 40 times: each is answered; the first 10 are recorded
    as PodRejected, the other 30 are counted in one SocketRefusals summary."""
    log = InMemoryEventLog()
    for event in NODE_EVENTS:
        await append(log, event)
    async with executor_on(log, tmp_path, identity="kernel"):
        codes = [
            await run_workload(
                tmp_path / "gpupool.sock",
                RunRequest(pod=A, argv=["true"], cwd="/", env={}),
                on_message=lambda message: None,
                fds=(devnull, devnull, devnull),
            )
            for _ in range(40)
        ]
    assert codes == [2] * 40
    events = [
        e.envelope.event
        for e in [entry async for entry in log.replay()]
        if isinstance(e, StoredEvent)
    ]
    rejected = [e for e in events if isinstance(e, PodRejected)]
    summaries = [e for e in events if isinstance(e, MessageRejected)]
    assert len(rejected) == 10 and {r.reason for r in rejected} == {"NotInAPod"}
    (summary,) = summaries
    assert summary.reason.startswith("SocketRefusals: 30 more refusals in ")
    counts = msgspec.json.decode(summary.payload)
    assert counts["by_reason"] == {"NotInAPod": 30}
