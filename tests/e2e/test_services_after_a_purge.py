"""After a purge the whole local stack goes on: every service resumes from its snapshot, the
node-executor from the archive's whole-cluster checkpoint (restricted to its node), and a pod
registered before the purge gets its GPU, runs and ends as before.

Real parts: nats-server, the four services as processes (`gpupool up`'s stack, snapshots in
<state>/snapshots), `gpupool run` clients, `gpupool log archive|purge` and `verify`."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import yaml
from stack_harness import running_stack, start_workload

from gpupool.cli.local_stack import LocalStack
from gpupool.cli.main import main
from gpupool.eventlog.archive import checkpoint_name
from gpupool.runtime.snapshot import decode_snapshot

ROOT = Path(__file__).resolve().parents[2]
NODE = "cn-wulanchabu-c.cr-xxx"
OTHER = "gpu-other.example"


def two_node_cluster() -> str:
    """The worked example's node and pods, plus another node with a pod of its own."""
    cluster = yaml.safe_load((ROOT / "scenarios" / "worked-example.yaml").read_text())
    cluster["nodes"].append({"name": OTHER, "gpus": 1, "policy": "share-pool"})
    cluster["pods"].append({"name": "pod-x", "node": OTHER, "requests": {"core": 50, "memory": 50}})
    cluster.pop("timeline", None)
    return yaml.safe_dump(cluster)


async def cli(*args: str) -> int:
    return await asyncio.to_thread(main, list(args))


async def run_to_the_end(stack: LocalStack, pod: str) -> None:
    workload = await start_workload(stack, pod)
    line = await workload.until_line(lambda text: text.startswith("running on"), within=60)
    assert line.startswith("running on"), workload.lines
    assert await workload.finish() == 0, workload.lines


async def test_the_stack_goes_on_after_a_purge_the_executor_from_the_checkpoint(
    tmp_path: Path,
) -> None:
    async with running_stack(tmp_path, two_node_cluster(), NODE, gpus=2) as stack:
        await run_to_the_end(stack, "pod-a")
        await stack.stop()  # each service drains and saves its snapshot
        snapshots = tmp_path / "state" / "snapshots"
        executor = snapshots / "node-executor-local.snapshot"
        saved = {path.name: decode_snapshot(path.read_bytes()) for path in snapshots.iterdir()}
        assert executor.name in saved and len(saved) == 4, sorted(saved)
        cut = min(snapshot.last_seq for snapshot in saved.values())
        where = ["--nats", stack.nats_url]
        archive = tmp_path / "archive"
        assert await cli("log", "archive", *where, "--to", str(archive), "--up-to", str(cut)) == 0
        purge = ["log", "purge", *where, "--archive", str(archive), "--up-to", str(cut)]
        assert await cli(*purge, "--snapshot-dir", str(snapshots)) == 0

        # the executor comes back from the archive's checkpoint, a fold of both nodes
        checkpoint = archive / checkpoint_name(cut)
        assert {n.name for n in decode_snapshot(checkpoint.read_bytes()).state.nodes} == {
            NODE,
            OTHER,
        }
        shutil.copy(checkpoint, executor)
        await stack.start()
        log = stack.services["node-executor"].log_path.read_text()
        assert f"keeping {NODE}'s part" in log, log[-2000:]
        assert "LogPurgedPastSnapshot" not in log

        # pods registered before the purge are served: each gets a GPU, runs and ends
        await run_to_the_end(stack, "pod-b")
        await run_to_the_end(stack, "pod-c")
        await stack.stop()
        resumed = decode_snapshot(executor.read_bytes())
        assert [n.name for n in resumed.state.nodes] == [NODE]  # its node only, from then on
        assert resumed.last_seq > cut
        assert await cli("verify", *where, "--archive", str(archive)) == 0
