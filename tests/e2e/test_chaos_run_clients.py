"""A bounded, seeded chaos test: SIGKILLs of every service and of nats-server while
``gpupool run`` clients keep running commands, and afterwards every client was told its
true outcome (issue 12).

Real parts: nats-server (its own process, killed and restarted on the same port and store),
the four services as processes (killed with SIGKILL; restarted at once by this test, as
``gpupool up`` would), and real ``gpupool run`` clients whose commands write a line to a
file and exit with a code chosen by the seed (0 or 3). Each pod runs its command again and
again, one run at a time, while faults come every ~0.6 s (the seed picks the target among
nats-server and the four services, and the pause).

Checked afterwards:

* every client's exit code is its command's (told its true outcome, no ``NothingToReattach``
  or internal error), and no command ran twice for one run (one line per run in its file);
* the log has, for every pod, exactly its runs' ends, in order, with their exit codes
  (``completed`` 0 / ``failed`` 3): nothing lost, nothing recorded twice;
* ``gpupool verify`` passes on the whole log;
* no process of the test (a command, a shim, a service) is left once it stopped.

It prints the counts: faults by target, runs, outcomes.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager, suppress
from pathlib import Path

import pytest

from gpupool.cli.audit import verify
from gpupool.cli.local_stack import SERVICES, StackSettings, free_port, local_stack
from gpupool.eventlog.jetstream import JetStreamEventLog
from gpupool.eventlog.nats_server import run_nats_server
from gpupool.eventlog.port import StoredEvent
from gpupool.events import Released

pytestmark = pytest.mark.integration

SEED = 1212
FAULTS = 50
PODS = 4
NODE = "chaos-node"
CLUSTER = f"""
nodes:
  - {{name: {NODE}, gpus: 2, policy: share-pool, qos: '{{"preemptEnabled": false}}'}}
pods:
""" + "".join(
    f"  - {{name: p{i}, node: {NODE}, requests: {{core: 50, memory: 50}},"
    " limits: {core: 50, memory: 50}}\n"
    for i in range(PODS)
)
COMMAND = (
    "import sys, time; open(sys.argv[1], 'a').write(sys.argv[2] + '\\n'); "
    "time.sleep(float(sys.argv[3])); sys.exit(int(sys.argv[4]))"
)
TOKEN = f"gpupool-chaos-{os.getpid()}"
"""In every command's argv: no process carrying it may be left at the end."""


class Nats:
    """nats-server on a fixed port and store, that can be killed and started again."""

    def __init__(self, store: Path) -> None:
        self.store = store
        self.port = free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self._running: AsyncExitStack | None = None

    async def start(self) -> None:
        running = AsyncExitStack()
        await running.enter_async_context(run_nats_server(self.store, port=self.port))
        self._running = running

    def pid(self) -> int | None:
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with suppress(OSError):
                    words = (entry / "cmdline").read_bytes().split(b"\0")
                    if str(self.store).encode() in words and b"-js" in words:
                        return int(entry.name)
        return None

    async def kill(self) -> None:
        pid = self.pid()
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
        if self._running is not None:
            await self._running.aclose()
            self._running = None

    async def stop(self) -> None:
        if self._running is not None:
            await self._running.aclose()
            self._running = None


@asynccontextmanager
async def chaos_stack(tmp_path: Path) -> AsyncIterator[tuple[Nats, object]]:
    nats = Nats(tmp_path / "nats")
    await nats.start()
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER)
    settings = StackSettings(
        cluster_file=cluster,
        node=NODE,
        state_dir=tmp_path / "state",
        simulate_gpus=2,
        message_period=0.5,
        log_level="INFO",
        nats_url=nats.url,
    )
    try:
        async with local_stack(settings) as stack:
            try:
                yield nats, stack
            except BaseException:
                for name, service in stack.services.items():
                    print(f"----- {name} log -----\n{service.log_tail(40)}")
                raise
    finally:
        await nats.stop()


async def run_client(socket: Path, pod: str, ran: Path, run: int, code: int) -> int:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpupool.cli.main", "run", "--socket", str(socket),
        "--pod", pod, "--reconnect-seconds", "60", "--",
        sys.executable, "-c", COMMAND, str(ran), f"{TOKEN}-{pod}-{run}", "0.3", str(code),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert process.stderr is not None
    err = await process.stderr.read()
    returncode = await process.wait()
    if returncode != code:
        print(f"{pod} run {run}: exit {returncode}, wanted {code}: {err.decode()[-600:]}")
    return returncode


def leftovers() -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with suppress(OSError):
                cmdline = (entry / "cmdline").read_bytes()
                stat = (entry / "stat").read_text()
                if TOKEN.encode() in cmdline and stat.rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(cmdline.replace(b"\0", b" ").decode(errors="replace"))
    return found


async def test_every_client_is_told_its_true_outcome_through_50_random_kills(
    tmp_path: Path,
) -> None:
    rng = random.Random(SEED)
    faults: Counter[str] = Counter()
    runs: dict[str, list[int]] = {f"p{i}": [] for i in range(PODS)}
    told: dict[str, list[int]] = {f"p{i}": [] for i in range(PODS)}
    plans = {pod: [rng.choice((0, 0, 3)) for _ in range(40)] for pod in runs}
    started = time.monotonic()
    async with chaos_stack(tmp_path) as (nats, stack):
        chaos_over = asyncio.Event()

        async def pod_loop(pod: str) -> None:
            ran = tmp_path / f"{pod}.ran"
            for run, code in enumerate(plans[pod]):
                if chaos_over.is_set() and run >= 2:
                    return
                runs[pod].append(code)
                told[pod].append(await run_client(stack.socket_path, pod, ran, run, code))  # type: ignore[attr-defined]

        async def keep_up(name: str) -> None:
            """Restart the service whenever it dies (as gpupool up does), at once."""
            while True:
                process = stack.services[name].process  # type: ignore[attr-defined]
                if process is not None:
                    await process.wait()
                with suppress(Exception):  # (it may die again while starting: next round)
                    await stack.restart(name)  # type: ignore[attr-defined]

        loops = [asyncio.create_task(pod_loop(pod)) for pod in runs]
        keepers = [asyncio.create_task(keep_up(name)) for name in SERVICES]
        try:
            for _ in range(FAULTS):
                await asyncio.sleep(rng.uniform(0.3, 0.9))  # the seeded pause between faults
                target = rng.choice(("nats-server", *SERVICES))
                if target == "nats-server":
                    await nats.kill()
                    await nats.start()
                else:
                    service = stack.services[target]  # type: ignore[attr-defined]
                    if service.running:
                        await stack.kill(target)  # type: ignore[attr-defined]
                faults[target] += 1
            chaos_over.set()
            async with asyncio.timeout(120):
                await asyncio.gather(*loops)
        finally:
            for keeper in keepers:
                keeper.cancel()
            await asyncio.gather(*keepers, return_exceptions=True)
            for loop in loops:
                loop.cancel()
        for name in SERVICES:
            if not stack.services[name].running:  # type: ignore[attr-defined]
                await stack.restart(name)  # type: ignore[attr-defined]
        log = await JetStreamEventLog.connect(nats.url)
        try:
            entries = [entry async for entry in log.replay()]
        finally:
            await log.close()
    elapsed = time.monotonic() - started

    outcomes = Counter(
        "completed" if c == 0 else "failed" for codes in runs.values() for c in codes
    )
    print(
        f"\nchaos: {sum(faults.values())} faults ({dict(sorted(faults.items()))}), "
        f"{sum(len(r) for r in runs.values())} runs, outcomes {dict(outcomes)}, "
        f"{elapsed:.0f}s"
    )
    assert sum(faults.values()) >= 50
    history = {
        pod: [
            f"{e.seq}:{type(e.envelope.event).__name__}"
            + (
                f"({e.envelope.event.reason},{e.envelope.event.exit_code})"
                if isinstance(e.envelope.event, Released)
                else ""
            )
            for e in entries
            if isinstance(e, StoredEvent)
            and getattr(e.envelope.event, "pod", None) is not None
            and e.envelope.event.pod.name == pod  # type: ignore[attr-defined]
        ]
        for pod in runs
    }
    assert told == runs, history  # every client was told its command's true end
    for pod in runs:  # every run's command ran exactly once
        lines = (tmp_path / f"{pod}.ran").read_text().split()
        assert lines == [f"{TOKEN}-{pod}-{run}" for run in range(len(runs[pod]))], pod
    released: dict[str, list[tuple[str, int | None]]] = {pod: [] for pod in runs}
    for entry in entries:
        if isinstance(entry, StoredEvent) and isinstance(entry.envelope.event, Released):
            event = entry.envelope.event
            released[event.pod.name].append((event.reason, event.exit_code))
    for pod, codes in runs.items():
        assert released[pod] == [
            ("completed", 0) if code == 0 else ("failed", code) for code in codes
        ], pod
    report = verify(entries)
    assert report.ok, report.violations[:3]
    assert leftovers() == []
