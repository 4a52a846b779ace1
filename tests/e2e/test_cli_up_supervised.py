"""``gpupool up`` as a user runs it: a real process, its own NATS, the four services, supervised.

A port already taken ends it before anything starts, naming the port; a service
killed with SIGKILL is restarted (with the restart reported) and the queue keeps
moving; a Ctrl-C stops the deciders, then the executor (which records the true
end of the running job), NATS last; pods added while it runs (``gpupool pod
add``) are registered and run; the other commands find its NATS without flags.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import msgspec
from stack_harness import of_type

from gpupool.cli.stack_address import RunningStack
from gpupool.eventlog.jetstream import JetStreamEventLog
from gpupool.eventlog.nats_server import run_nats_server
from gpupool.eventlog.port import StoredEvent
from gpupool.events import Assigned, Envelope, PodReady, Released
from gpupool.workload.messages import EXIT_EXECUTOR_UNAVAILABLE

NODE = "local-node"
CLUSTER = f"""
nodes:
  - {{name: {NODE}, gpus: 1, policy: share-pool, qos: '{{"preemptEnabled": false}}'}}
pods:
  - {{name: pod-a, node: {NODE}, requests: {{core: 50, memory: 50}}, limits: {{core: 100, memory: 100}}}}
  - {{name: pod-b, node: {NODE}, requests: {{core: 50, memory: 50}}, limits: {{core: 100, memory: 100}}}}
"""
TASK = "import sys; print('working', flush=True); sys.stdin.readline()"


@dataclass
class Lines:
    """A process's output, line by line, awaited by predicate."""

    process: asyncio.subprocess.Process
    lines: list[str] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    reader: asyncio.Task[None] | None = None

    def start_reading(self) -> Lines:
        self.reader = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        assert self.process.stdout is not None
        async for raw in self.process.stdout:
            self.lines.append(raw.decode(errors="replace").rstrip("\n"))
            self.changed.set()
        self.changed.set()

    async def until(self, text: str, *, within: float = 60.0) -> str:
        async with asyncio.timeout(within):
            while True:
                for line in self.lines:
                    if text in line:
                        return line
                if self.reader is not None and self.reader.done():
                    raise AssertionError(f"ended without {text!r}: {self.lines}")
                self.changed.clear()
                await self.changed.wait()

    async def exit_code(self, within: float = 60.0) -> int:
        async with asyncio.timeout(within):
            code = await self.process.wait()
            if self.reader is not None:
                await self.reader
        return code


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "gpupool.cli.main", *args]


def environment(state_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "GPUPOOL_NATS_URL"}
    env["GPUPOOL_STATE_DIR"] = str(state_dir)
    return env


async def spawn(*argv: str, state_dir: Path, new_session: bool = False) -> Lines:
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=environment(state_dir),
        start_new_session=new_session,
    )
    return Lines(process).start_reading()


@dataclass
class Up:
    output: Lines
    state_dir: Path
    cluster: Path

    @property
    def running(self) -> RunningStack:
        return msgspec.json.decode((self.state_dir / "up.json").read_bytes(), type=RunningStack)

    async def pod(self, name: str) -> Lines:
        return await spawn(
            *cli("run", "--socket", self.running.socket, "--pod", name, "--"),
            sys.executable,
            "-c",
            TASK,
            state_dir=self.state_dir,
        )

    def service_pid(self, module: str) -> int:
        """The pid of the service process running ``module`` for this stack (from /proc)."""
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                words = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if module.encode() in words and str(self.state_dir).encode() in b" ".join(words):
                return int(entry.name)
        raise AssertionError(f"no {module} process of {self.state_dir}")

    def ctrl_c(self) -> None:
        """What a terminal does on Ctrl-C: SIGINT to the foreground process group."""
        os.killpg(self.output.process.pid, signal.SIGINT)


@asynccontextmanager
async def gpupool_up(tmp_path: Path, cluster: str = CLUSTER) -> AsyncIterator[Up]:
    state_dir = tmp_path / "state"
    cluster_file = tmp_path / "cluster.yaml"
    cluster_file.write_text(cluster)
    output = await spawn(
        *cli("up", "--cluster", str(cluster_file), "--node-name", NODE, "--simulate-gpus", "1",
             "--any-ports", "--message-period", "0.5", "--state-dir", str(state_dir)),
        state_dir=state_dir,
        new_session=True,
    )  # fmt: skip
    up = Up(output=output, state_dir=state_dir, cluster=cluster_file)
    try:
        await output.until("Ctrl-C stops everything.")
        yield up
    except BaseException:
        print("\n".join(output.lines))
        for log in (state_dir / "logs").glob("*.log"):
            print(f"----- {log.name}\n{log.read_text(errors='replace')[-3000:]}")
        raise
    finally:
        if output.process.returncode is None:
            with suppress(ProcessLookupError):
                output.process.send_signal(signal.SIGTERM)
            await output.exit_code()


async def finish(pod: Lines) -> int:
    assert pod.process.stdin is not None
    with suppress(ConnectionError):
        pod.process.stdin.write(b"done\n")
        await pod.process.stdin.drain()
    return await pod.exit_code()


async def read_log(url: str) -> list[Envelope]:
    log = await JetStreamEventLog.connect(url)
    try:
        return [e.envelope async for e in log.replay() if isinstance(e, StoredEvent)]
    finally:
        await log.close()


async def test_a_taken_port_ends_up_before_anything_starts_and_names_the_port(
    tmp_path: Path,
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cluster = tmp_path / "cluster.yaml"
        cluster.write_text(CLUSTER)
        output = await spawn(
            *cli("up", "--cluster", str(cluster), "--node-name", NODE, "--simulate-gpus", "1",
                 "--nats-port", str(port), "--state-dir", str(tmp_path / "state")),
            state_dir=tmp_path / "state",
        )  # fmt: skip
        code = await output.exit_code()
    assert code == 1
    assert any(f"port {port} (NATS)" in line for line in output.lines), output.lines
    assert not any("gpupool is up" in line for line in output.lines)
    assert not (tmp_path / "state" / "up.json").exists()


async def test_a_killed_service_is_restarted_and_the_queue_keeps_moving(tmp_path: Path) -> None:
    async with gpupool_up(tmp_path) as up:
        pod_a = await up.pod("pod-a")
        await pod_a.until("working")
        pod_b = await up.pod("pod-b")
        await pod_b.until("Approximate position: 1")

        os.kill(up.service_pid("gpupool.admission_queue"), signal.SIGKILL)
        restarted = await up.output.until("admission-queue exited with status -9")
        assert "restarting it in 1s (restart 1" in restarted
        await up.output.until("admission-queue is back")

        # pod-a ends; the restarted admission-queue hands its GPU to pod-b
        assert await finish(pod_a) == 0
        await pod_b.until("working")
        assert await finish(pod_b) == 0
        log = await read_log(up.running.nats_url)
    assert [e.event.pod.name for e in of_type(log, Assigned)] == ["pod-a", "pod-b"]  # type: ignore[attr-defined]


async def test_ctrl_c_records_the_true_end_of_running_jobs_and_stops_nats_last(
    tmp_path: Path,
) -> None:
    async with gpupool_up(tmp_path) as up:
        pod_a = await up.pod("pod-a")
        await pod_a.until("working")
        pod_b = await up.pod("pod-b")
        await pod_b.until("Approximate position: 1")

        pressed = datetime.now(UTC)
        up.ctrl_c()
        assert await up.output.exit_code() == 0
        stopped = datetime.now(UTC)
        # the clients were told (the running one and the waiting one): neither waits for an
        # executor to come back
        for pod in (pod_a, pod_b):
            assert await pod.exit_code(within=20) == EXIT_EXECUTOR_UNAVAILABLE, pod.lines
            assert not any("reconnect" in line for line in pod.lines), pod.lines
    assert any("stopped" in line for line in up.output.lines)
    assert not (up.state_dir / "up.json").exists()

    # the log, read from NATS' own store after everything stopped
    async with run_nats_server(up.state_dir / "nats") as url:
        log = await read_log(url)
    (released_a,) = of_type(log, Released, "pod-a")
    assert released_a.event.reason == "cancelled"  # type: ignore[attr-defined]
    assert pressed <= released_a.time <= stopped, (pressed, released_a.time, stopped)
    # nothing was assigned while stopping: pod-b left the queue without a GPU
    assert [e.event.pod.name for e in of_type(log, Assigned)] == ["pod-a"]  # type: ignore[attr-defined]
    (released_b,) = of_type(log, Released, "pod-b")
    assert released_b.event.gpu_index is None  # type: ignore[attr-defined]
    assert pressed <= released_b.time <= stopped


async def test_pods_added_while_up_runs_are_registered_and_the_commands_find_its_nats(
    tmp_path: Path,
) -> None:
    empty = "# the operator's notes\n" + CLUSTER.split("pods:")[0] + "pods: []\n"
    async with gpupool_up(tmp_path, empty) as up:
        added = await spawn(
            *cli("pod", "add", "pod-x", "--core", "50", "--memory", "50"),
            state_dir=up.state_dir,
        )
        assert await added.exit_code() == 0, added.lines
        assert "pod default/pod-x added to" in added.lines[0]
        # it returns once the log holds the registration: a run started now finds the pod
        assert added.lines[-1] == "pod default/pod-x registered on node local-node", added.lines
        assert up.cluster.read_text().startswith(empty.split("pods:")[0])  # comments kept
        refused = await spawn(
            *cli("pod", "add", "pod-y", "--core", "50", "--memory", "50", "--limit-core", "40"),
            state_dir=up.state_dir,
        )
        assert await refused.exit_code() != 0, refused.lines
        assert any("pod default/pod-y was rejected (" in line for line in refused.lines), (
            refused.lines
        )
        pod_x = await up.pod("pod-x")
        await pod_x.until("working")
        assert await finish(pod_x) == 0

        # `gpupool log` without --nats: the NATS of the running `gpupool up`
        shown = await spawn(*cli("log", "--type", "Assigned"), state_dir=up.state_dir)
        assert await shown.exit_code() == 0, shown.lines
        assert any("pod-x" in line for line in shown.lines), shown.lines
        log = await read_log(up.running.nats_url)
    assert [e.event.pod.name for e in of_type(log, PodReady)] == ["pod-x"]  # type: ignore[attr-defined]
