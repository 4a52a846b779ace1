"""Retention on a real nats-server: `gpupool log archive` exports the stream byte for byte into
sealed segments and continues where it ended; `gpupool log purge` removes only what every
reader can start past; `verify` and `log` read archive + stream as one log; a service comes
back after a purge from its snapshot (or the archive's checkpoint) with the same state."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
from collections.abc import Iterator
from contextlib import AsyncExitStack
from pathlib import Path

import msgspec
import pytest
import yaml
from log_streams import delete_stream, unique_stream

from gpupool.admission_queue.service import AdmissionQueue
from gpupool.cli.main import main
from gpupool.core import RemovePod
from gpupool.core.simulation import Scenario, simulate
from gpupool.eventlog import JetStreamEventLog, jetstream
from gpupool.eventlog.archive import Archive, StreamOperator, checkpoint_name, segment_name
from gpupool.eventlog.log_client import LogClient
from gpupool.eventlog.nats_server import run_nats_server
from gpupool.eventlog.port import StoredEvent
from gpupool.eventlog.reader import ReadOnlyLog
from gpupool.events import Envelope, PodRef, PodRegistered, event_node
from gpupool.runtime.decider import DeciderLoop
from gpupool.runtime.projection import Projection, metrics_projection
from gpupool.runtime.service import LogPurgedPastSnapshot, ServiceOptions, run_service
from gpupool.runtime.snapshot import decode_snapshot, encode_snapshot

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def worked_example() -> list[Envelope]:
    scenario = msgspec.convert(
        yaml.safe_load((ROOT / "scenarios" / "worked-example.yaml").read_text()), Scenario
    )
    return simulate(scenario)


ENVELOPES = worked_example()  # 15 entries


def gpupool(*args: str) -> int:
    """The CLI in this process (its own event loop, in a thread: the test's loop runs)."""
    return main(list(args))


async def cli(*args: str) -> int:
    return await asyncio.to_thread(gpupool, *args)


def source(nats_url: str, log: JetStreamEventLog) -> list[str]:
    return ["--nats", nats_url, "--stream", log.stream, "--subject-prefix", log.subject_prefix]


async def filled(log: JetStreamEventLog) -> None:
    """The worked example, with an unreadable entry as the 8th."""
    await log.append_many(ENVELOPES[:7])
    await log.append_raw(f"{log.subject_prefix}._.gpupool", b"\xff\x00{not json")
    await log.append_many(ENVELOPES[7:])


async def stream_messages(nats_url: str, log: JetStreamEventLog, until: int) -> list[object]:
    reader = await ReadOnlyLog.connect(
        nats_url, stream=log.stream, subject_prefix=log.subject_prefix
    )
    try:
        return [m async for m in reader.messages(until_seq=until)]
    finally:
        await reader.close()


async def test_archive_exports_every_entry_byte_for_byte_and_continues_where_it_ended(
    nats_url: str,
    jetstream_log: JetStreamEventLog,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    await filled(jetstream_log)
    target = tmp_path / "archive"
    where = source(nats_url, jetstream_log)
    args = ["log", "archive", *where, "--to", str(target), "--segment-entries", "4"]
    assert await cli(*args, "--up-to", "10") == 0
    archive = Archive(target)
    assert [(s.manifest.first_seq, s.manifest.last_seq) for s in archive.sealed()] == [
        (1, 4),
        (5, 8),
        (9, 10),
    ]
    assert list(archive.messages()) == await stream_messages(nats_url, jetstream_log, 10)
    garbage = next(m for m in archive.messages() if m.seq == 8)
    assert garbage.data == b"\xff\x00{not json"
    assert all(m.headers.get("Nats-Msg-Id") for m in archive.messages() if m.seq != 8)
    assert (target / checkpoint_name(10)).is_file()

    # a crash left a segment half written: never taken as complete, written again
    (target / segment_name(11, 14)).write_bytes(b'{"seq": 11, "subj')
    capfd.readouterr()
    assert await cli(*args) == 0
    said = capfd.readouterr().out
    assert f"removed {segment_name(11, 14)}: left unsealed" in said
    assert "archive" in said and "ends at sequence 16" in said
    assert list(archive.messages()) == await stream_messages(nats_url, jetstream_log, 16)

    assert await cli(*args) == 0  # idempotent
    assert "nothing new to archive" in capfd.readouterr().out
    assert archive.last_seq == 16


async def test_verify_reads_archive_and_stream_as_one_log_after_a_purge(
    nats_url: str,
    jetstream_log: JetStreamEventLog,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    await filled(jetstream_log)
    where = source(nats_url, jetstream_log)
    assert await cli("verify", *where) == 0
    before = capfd.readouterr().out.splitlines()[0]
    assert before.startswith("verify: OK, 16 entries (1 unreadable)")
    target = str(tmp_path / "archive")
    assert await cli("log", "archive", *where, "--to", target, "--up-to", "9") == 0

    assert await cli("log", "purge", *where, "--archive", target, "--up-to", "12") == 1
    assert (
        "the archive ends at sequence 9: entries 10..12 are not archived" in capfd.readouterr().err
    )
    assert await cli("log", "purge", *where, "--archive", target, "--up-to", "9") == 0
    assert "purged 9 entries up to sequence 9" in capfd.readouterr().out

    assert await cli("verify", *where) == 1
    assert "starts at sequence 10: entries 1..9 were purged; read the log with --archive" in (
        capfd.readouterr().err
    )
    assert await cli("verify", *where, "--archive", target) == 0
    assert capfd.readouterr().out.splitlines()[0] == before
    assert await cli("log", *where, "--archive", target, "-o", "json") == 0
    assert [e["seq"] for e in json.loads(capfd.readouterr().out)] == list(range(1, 17))

    # a changed archive, an archive that stops short of the stream: specific errors
    short = tmp_path / "short"
    shutil.copytree(target, short)
    for path in short.glob("segment-000000000001-*"):
        path.write_bytes(path.read_bytes().replace(b'"seq":1,', b'"seq":1 ,'))
    assert await cli("verify", *where, "--archive", str(short)) == 1
    assert "sha256 is" in capfd.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert await cli("verify", *where, "--archive", str(empty)) == 1
    assert "ends at 0: entries 1..9 are in neither" in capfd.readouterr().err


async def test_a_purge_nobody_archived_first_cannot_be_archived_over(
    nats_url: str,
    jetstream_log: JetStreamEventLog,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    await filled(jetstream_log)
    where = source(nats_url, jetstream_log)
    first = str(tmp_path / "first")
    assert await cli("log", "archive", *where, "--to", first, "--up-to", "6") == 0
    assert await cli("log", "purge", *where, "--archive", first, "--up-to", "6") == 0
    capfd.readouterr()
    other = str(tmp_path / "other")
    assert await cli("log", "archive", *where, "--to", other) == 1
    assert "entries 1..6 were purged without being archived" in capfd.readouterr().err


async def test_a_purge_with_the_archive_of_another_stream_is_refused(
    nats_url: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    logs = []
    for _ in range(2):
        stream, prefix = unique_stream()
        logs.append(await JetStreamEventLog.connect(nats_url, stream=stream, subject_prefix=prefix))
    try:
        for log in logs:
            await filled(log)
        target = str(tmp_path / "archive")
        assert await cli("log", "archive", *source(nats_url, logs[0]), "--to", target) == 0
        other = source(nats_url, logs[1])
        assert await cli("log", "archive", *other, "--to", target, "--up-to", "99") == 1
        assert "ends at sequence 16: cannot archive up to 99" in capfd.readouterr().err
        assert await cli("log", "purge", *other, "--archive", target, "--up-to", "16") == 1
        assert f"is of stream {logs[0].stream}, not {logs[1].stream}" in capfd.readouterr().err
        assert len(await stream_messages(nats_url, logs[1], 16)) == 16  # nothing purged
    finally:
        for log in logs:
            await log.close()
            await delete_stream(nats_url, log.stream)


async def test_deciders_append_for_nodes_whose_entries_were_all_purged(
    nats_url: str, jetstream_log: JetStreamEventLog
) -> None:
    """After a purge a node's subjects may hold no entry: the server's last sequence for them
    is 0, below what the projection folded. A decision there must land, not conflict for ever
    (every writer's expectations: the node's, and one writer's)."""
    await filled(jetstream_log)
    loop = DeciderLoop(jetstream_log, service="admission-queue", projection=metrics_projection())
    await loop.rebuild()
    last = loop.projection.last_seq
    operator = await StreamOperator.connect(
        nats_url, stream=jetstream_log.stream, subject_prefix=jetstream_log.subject_prefix
    )
    try:
        await operator.purge_through(last)
        assert await operator.sequences() == (last + 1, last)
    finally:
        await operator.close()
    node = event_node(ENVELOPES[0].event)
    pods = [pod for pod in loop.projection.state.pods.values() if pod.node == node]
    removed = await loop.execute(RemovePod(pod=pods[0].ref, node=node), node=node)
    assert [type(event).__name__ for event in removed] == ["PodRemoved"]
    assert loop.projection.last_seq == last + 1
    assert loop.conflicts == 1  # the one refused append that taught it the purge


@pytest.fixture
def service_logs() -> Iterator[list[str]]:
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Collect()
    logger = logging.getLogger("gpupool.runtime.service")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield seen
    logger.removeHandler(handler)


async def run_until_rebuilt(options: ServiceOptions, seen: list[str]) -> None:
    """Start the admission-queue, wait until it has rebuilt and holds its durable consumer,
    stop it (it saves its snapshot)."""
    stop = asyncio.Event()
    count = len(seen)
    service = asyncio.create_task(
        run_service(AdmissionQueue(), options, stop, projection_factory=metrics_projection)
    )
    operator = await StreamOperator.connect(options.nats_url, stream=options.stream)

    async def consuming() -> bool:  # the durable is claimed after the rebuild is logged
        return f"admission-queue-{options.instance}" in await operator.durables()

    try:
        async with asyncio.timeout(60):
            while not any("rebuilt from" in line for line in seen[count:]) or not (
                await consuming()
            ):
                done, _ = await asyncio.wait({service}, timeout=0.05)
                if done:
                    await service  # it failed: raise what it raised
    finally:
        await operator.close()
        stop.set()
        async with asyncio.timeout(30):
            await asyncio.gather(service, return_exceptions=True)
    await service


async def test_a_service_restarts_after_a_purge_from_its_snapshot_with_the_same_state(
    tmp_path: Path, service_logs: list[str], capfd: pytest.CaptureFixture[str]
) -> None:
    snapshots = tmp_path / "snapshots"
    async with run_nats_server(tmp_path / "nats") as url:
        log = await JetStreamEventLog.connect(url)
        try:
            await filled(log)
        finally:
            await log.close()
        options = ServiceOptions(
            nats_url=url,
            http_host="127.0.0.1",
            http_port=0,
            stream="GPUPOOL",
            instance="t",
            snapshot_dir=snapshots,
        )
        await run_until_rebuilt(options, service_logs)
        saved = decode_snapshot((snapshots / "admission-queue-t.snapshot").read_bytes())
        cut = saved.last_seq
        assert cut >= 16
        where = ["--nats", url]
        archive = str(tmp_path / "archive")
        assert await cli("log", "archive", *where, "--to", archive, "--up-to", str(cut)) == 0
        # the service's durable needs a snapshot past the cut
        assert await cli("log", "purge", *where, "--archive", archive, "--up-to", str(cut)) == 1
        assert "no snapshot given for the durable consumer(s) admission-queue-t" in (
            capfd.readouterr().err
        )
        purge = ["log", "purge", *where, "--archive", archive, "--up-to", str(cut)]
        assert await cli(*purge, "--snapshot-dir", str(snapshots)) == 0

        await run_until_rebuilt(options, service_logs)
        assert f"admission-queue: resuming after sequence {cut} from the snapshot" in service_logs
        again = decode_snapshot((snapshots / "admission-queue-t.snapshot").read_bytes())
        assert again.last_seq == cut and again.state == saved.state

        # a replica with no snapshot refuses to rebuild from the purged log, saying how
        fresh = msgspec.structs.replace(options, instance="u")
        with pytest.raises(LogPurgedPastSnapshot, match=f"starts at sequence {cut + 1}"):
            await run_until_rebuilt(fresh, service_logs)
        # ... and comes up from the archive's checkpoint with the same state
        shutil.copy(Path(archive) / checkpoint_name(cut), snapshots / "admission-queue-u.snapshot")
        await run_until_rebuilt(fresh, service_logs)
        replica = decode_snapshot((snapshots / "admission-queue-u.snapshot").read_bytes())
        assert replica.last_seq == cut and replica.state == saved.state


class PartitionRecorder:
    """A partitioned service that records what it is handed (the node-executor's place)."""

    name = "node-executor"

    def __init__(self) -> None:
        self.loop: DeciderLoop | None = None
        self.handed: list[StoredEvent] = []
        self.new = asyncio.Event()

    async def start(self, loop: DeciderLoop, stack: AsyncExitStack) -> None:
        self.loop = loop

    async def react(self, entry: StoredEvent) -> None:
        self.handed.append(entry)
        self.new.set()


def other_node_log(node: str) -> list[Envelope]:
    """The preemption scenario's traffic on ``node`` (ids of its own)."""
    scenario = msgspec.convert(
        yaml.safe_load((ROOT / "scenarios" / "preemption-priority.yaml").read_text()), Scenario
    )
    scenario = msgspec.structs.replace(
        scenario,
        nodes=[msgspec.structs.replace(n, name=node) for n in scenario.nodes],
        pods=[msgspec.structs.replace(p, node=node) for p in scenario.pods],
        timeline=[
            msgspec.structs.replace(a, node=node) if a.node is not None else a
            for a in scenario.timeline
        ],
    )
    return [msgspec.structs.replace(e, id=f"other-{e.id}") for e in simulate(scenario)]


async def test_a_partitioned_executor_starts_after_a_purge_from_the_whole_cluster_checkpoint(
    tmp_path: Path, service_logs: list[str]
) -> None:
    node = event_node(ENVELOPES[0].event)
    other = "gpu-other.example"
    cluster = sorted([*ENVELOPES, *other_node_log(other)], key=lambda e: e.time)
    snapshots = tmp_path / "snapshots"
    snapshots.mkdir()
    async with run_nats_server(tmp_path / "nats") as url:
        log = await JetStreamEventLog.connect(url)
        try:
            await log.append_many(cluster)
            cut = await log.last_seq()
            where = ["--nats", url]
            archive = Path(tmp_path / "archive")
            assert await cli("log", "archive", *where, "--to", str(archive)) == 0
            assert (
                await cli("log", "purge", *where, "--archive", str(archive), "--up-to", str(cut))
                == 0
            )
            checkpoint = decode_snapshot((archive / checkpoint_name(cut)).read_bytes())
            whole = Projection.from_snapshot(checkpoint)
            assert set(whole.state.nodes) == {node, other}  # a whole-cluster fold
            shutil.copy(
                archive / checkpoint_name(cut),
                snapshots / "node-executor-t.snapshot",
            )

            options = ServiceOptions(
                nats_url=url,
                http_host="127.0.0.1",
                http_port=0,
                stream="GPUPOOL",
                instance="t",
                snapshot_dir=snapshots,
            )
            service = PartitionRecorder()
            stop = asyncio.Event()
            running = asyncio.create_task(run_service(service, options, stop, partition=node))
            try:
                async with asyncio.timeout(30):
                    while not any("rebuilt from" in line for line in service_logs):
                        done, _ = await asyncio.wait({running}, timeout=0.05)
                        if done:
                            await running  # it failed (before: LogPurgedPastSnapshot)
                assert service.loop is not None
                projection = service.loop.projection
                assert projection.last_seq == cut
                assert set(projection.state.nodes) == {node}
                assert {ref for ref in projection.state.pods} == {
                    ref for ref, pod in whole.state.pods.items() if pod.node == node
                }
                for ref, pod in projection.state.pods.items():
                    assert pod == whole.state.pods[ref]  # each of its pods as it was
                assert projection.state.nodes[node] == whole.state.nodes[node]

                # it goes on with its node's new entries, and is handed none of the other's
                first = next(e for e in ENVELOPES if isinstance(e.event, PodRegistered))
                late = msgspec.structs.replace(
                    first, id="late-registration", time=ENVELOPES[-1].time
                )
                registered = msgspec.structs.replace(
                    late,
                    event=msgspec.structs.replace(
                        late.event, pod=PodRef(namespace="default", name="late")
                    ),
                )
                elsewhere = msgspec.structs.replace(other_node_log(other)[0], id="late-other")
                await log.append(elsewhere)  # an entry of the other node, before its own
                seq = await log.append(registered)
                async with asyncio.timeout(30):
                    while not any(e.seq == seq for e in service.handed):
                        service.new.clear()
                        await service.new.wait()
                assert {event_node(e.envelope.event) for e in service.handed} == {node}
                assert PodRef(namespace="default", name="late") in projection.state.pods
            finally:
                stop.set()
                async with asyncio.timeout(30):
                    await asyncio.gather(running, return_exceptions=True)
            await running
            saved = decode_snapshot((snapshots / "node-executor-t.snapshot").read_bytes())
            resumed = Projection.from_snapshot(saved)
            assert set(resumed.state.nodes) == {node} and resumed.last_seq == seq
            # its snapshot is named as its durable: a purge past the cut finds it
            assert await cli("log", "archive", *where, "--to", str(archive)) == 0
            purge = ["log", "purge", *where, "--archive", str(archive), "--up-to", str(seq)]
            assert await cli(*purge, "--snapshot-dir", str(snapshots)) == 0
        finally:
            await log.close()


async def durables_of(nats_url: str, log: JetStreamEventLog) -> list[str]:
    operator = await StreamOperator.connect(
        nats_url, stream=log.stream, subject_prefix=log.subject_prefix
    )
    try:
        return await operator.durables()
    finally:
        await operator.close()


async def test_a_durable_nobody_pulls_from_expires_and_no_longer_holds_a_purge_back(
    nats_url: str,
    jetstream_log: JetStreamEventLog,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A replica gone for good (scaled away, its node removed) leaves its durable slot behind;
    the server deletes it after its ``inactive_threshold`` (SLOT_INACTIVE_SECONDS, 300 s;
    2 s here), while the slot of a running replica, waiting on an empty log, stays."""
    monkeypatch.setattr(jetstream, "SLOT_INACTIVE_SECONDS", 2.0)
    await filled(jetstream_log)
    cut = await jetstream_log.last_seq()
    replicas = {
        name: await JetStreamEventLog.connect(
            nats_url,
            stream=jetstream_log.stream,
            subject_prefix=jetstream_log.subject_prefix,
            claimant=name,
        )
        for name in ("running", "gone")
    }
    try:
        # as run_service does: each replica claims a slot admission-queue-<n> as its own
        running = replicas["running"].subscribe(durable="admission-queue")
        gone = replicas["gone"].subscribe(durable="admission-queue")
        for subscription in (running, gone):
            async with asyncio.timeout(30):
                seen = 0
                while seen < cut:
                    delivery = await anext(subscription)
                    seen = delivery.entries[-1].seq
                    await delivery.ack()
        # both wait on the log's end (a pull request outstanding: activity for the server)
        waiting = asyncio.create_task(anext(running))
        waiting_too = asyncio.create_task(anext(gone))
        infos = await jetstream_log._js.consumers_info(jetstream_log.stream)
        assert {info.config.inactive_threshold for info in infos} == {2.0}
        where = source(nats_url, jetstream_log)
        archive = tmp_path / "archive"
        assert await cli("log", "archive", *where, "--to", str(archive)) == 0
        snapshot = tmp_path / "admission-queue-running.snapshot"
        snapshot.write_bytes(encode_snapshot(Projection(last_seq=cut).to_snapshot()))
        purge = ["log", "purge", *where, "--archive", str(archive), "--up-to", str(cut)]
        assert await cli(*purge, "--snapshot", str(snapshot)) == 1
        assert "no snapshot given for the durable consumer(s) admission-queue-gone" in (
            capfd.readouterr().err
        )
        assert await durables_of(nats_url, jetstream_log) == [
            "admission-queue-gone",
            "admission-queue-running",
        ]
        waiting_too.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting_too
        # the server announces each consumer it deletes (an advisory): wait on those
        advisories = LogClient()  # its flush() follows the SUB (nats-py's could precede it)
        await advisories.connect(nats_url)
        deleted: asyncio.Queue[object] = asyncio.Queue()

        async def on_deleted(msg: object) -> None:
            await deleted.put(msg)

        await advisories.subscribe(
            f"$JS.EVENT.ADVISORY.CONSUMER.DELETED.{jetstream_log.stream}.*", cb=on_deleted
        )
        await advisories.flush()
        await gone.aclose()  # the replica that went away; `running` waits for more
        await replicas.pop("gone").close()
        try:
            async with asyncio.timeout(30):
                while "admission-queue-gone" in await durables_of(nats_url, jetstream_log):
                    await deleted.get()
            assert await durables_of(nats_url, jetstream_log) == ["admission-queue-running"]
            assert not waiting.done()  # its subscriber was never told anything
            assert await cli(*purge, "--snapshot", str(snapshot)) == 0
        finally:
            await advisories.close()
            waiting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
            await running.aclose()
    finally:
        for log in replicas.values():
            await log.close()
