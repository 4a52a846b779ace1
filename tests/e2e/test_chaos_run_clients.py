"""A bounded, seeded chaos test: SIGKILLs of every service and of nats-server while
``gpupool run`` clients keep running commands, and afterwards every client was told its
true outcome (issue 12).

Real parts: nats-server (its own process, killed and restarted on the same port and store),
the four services as processes (killed with SIGKILL; restarted at once by this test, as
``gpupool up`` would), and real ``gpupool run`` clients whose commands write a line to a
file and exit with a code chosen by the seed (0 or 3). Each pod runs its command again and
again, one run at a time, while faults come every ~0.6 s (the seed picks the target among
nats-server and the four services, and the pause).

A fault counts only when it was real: the target's process was alive (in ``/proc``, not a
zombie), received the SIGKILL, and is gone afterwards (a service's exit status is -SIGKILL;
nats-server's pid is reaped). A draw whose target was down (still restarting) is skipped and
drawn again, until ``FAULTS`` real faults and ``MIN_KILLS_PER_TARGET`` of each target (a
target short of its quota is drawn first), within ``MAX_DRAWS`` draws and
``CHAOS_DEADLINE_S``, else the test fails saying so.

Checked afterwards:

* every client's exit code is its command's (told its true outcome, no ``NothingToReattach``
  or internal error), and no command ran twice for one run (one line per run in its file);
* the log has, for every pod, exactly its runs' ends, in order, with their exit codes
  (``completed`` 0 / ``failed`` 3): nothing lost, nothing recorded twice;
* ``gpupool verify`` passes on the whole log;
* no process the test started is left once it stopped: every one of them (nats-server, the
  services, the clients, the shims, the commands) inherits ``MARKER`` in its environment, and
  no live process may carry it at the end. While the stack runs, the same scan must find
  nats-server and every service (so it is known to see them).

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
from gpupool.cli.local_stack import (
    SERVICES,
    LocalStack,
    ServiceProcess,
    StackSettings,
    free_port,
    local_stack,
)
from gpupool.eventlog.jetstream import JetStreamEventLog
from gpupool.eventlog.nats_server import run_nats_server
from gpupool.eventlog.port import Entry, StoredEvent
from gpupool.eventlog.subjects import writer_of_subject
from gpupool.events import Released

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
"""Above the suite's 120 s: a run that cannot reach its faults gives up (CHAOS_DEADLINE_S)
and the drain is bounded (DRAIN_TIMEOUT_S), so the test's own message, not the timeout,
says what failed. A run here takes 60-80 s."""

SEED = 1212
FAULTS = 50
TARGETS = ("nats-server", *SERVICES)
MIN_KILLS_PER_TARGET = 5
MAX_DRAWS = 150
CHAOS_DEADLINE_S = 100.0
"""Draws, and seconds, allowed to reach FAULTS real faults and each target's quota (a run
here: 50 draws, about 36 s)."""
DRAIN_TIMEOUT_S = 120.0
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
"""In every command's argv, and the value of MARKER in every process the test starts."""
MARKER = "GPUPOOL_CHAOS_TEST_TOKEN"
"""Set in this test's environment before anything starts: every process it starts inherits
it (nats-server, the services and what they start, the clients, their commands)."""


def process_state(pid: int) -> str | None:
    """The state letter of ``/proc/<pid>/stat`` (``Z``: a zombie), None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def is_alive(pid: int) -> bool:
    return process_state(pid) not in (None, "Z")


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

    async def kill(self) -> bool:
        """SIGKILL it; True when it was alive, got the signal, and is gone (reaped) after."""
        pid = self.pid()
        delivered = False
        if pid is not None and is_alive(pid):
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                delivered = True
        if self._running is not None:
            await self._running.aclose()  # waits for the process: reaped
            self._running = None
        return delivered and pid is not None and process_state(pid) is None

    async def stop(self) -> None:
        if self._running is not None:
            await self._running.aclose()
            self._running = None


@asynccontextmanager
async def chaos_stack(tmp_path: Path) -> AsyncIterator[tuple[Nats, LocalStack]]:
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


async def kill_service(service: ServiceProcess) -> bool:
    """SIGKILL the service's process; True when it was alive and died of that signal."""
    process = service.process
    if process is None or process.returncode is not None or not is_alive(process.pid):
        return False
    try:
        process.send_signal(signal.SIGKILL)
    except ProcessLookupError:
        return False
    async with asyncio.timeout(30):
        code = await process.wait()
    return code == -signal.SIGKILL


def marked_processes() -> dict[int, str]:
    """Every live process (not a zombie) but this one that carries the test's marker in its
    environment or its token in its argv: pid -> command line."""
    found = {}
    marker = f"{MARKER}={TOKEN}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with suppress(OSError):
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
            if (marker in environ.split(b"\0") or TOKEN.encode() in cmdline) and is_alive(
                int(entry.name)
            ):
                found[int(entry.name)] = cmdline.replace(b"\0", b" ").decode(errors="replace")
    return found


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def leftovers(within: float = 10.0) -> dict[int, str]:
    """The marked processes still alive ``within`` seconds after the stack stopped (processes
    that are exiting get that long to go)."""
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + within
    for pid in marked_processes():
        try:
            pidfd = os.pidfd_open(pid)  # readable once the process has exited
        except ProcessLookupError:
            continue  # gone already
        exited: asyncio.Future[None] = loop.create_future()
        loop.add_reader(pidfd, _settle, exited)
        try:
            async with asyncio.timeout_at(give_up_at):
                await exited
        except TimeoutError:
            break  # the ones still alive are reported below
        finally:
            loop.remove_reader(pidfd)
            os.close(pidfd)
    return marked_processes()


def log_window(entries: list[Entry], seq: int, before: int = 12, after: int = 12) -> str:
    """The log's entries around ``seq``, one line each (writer, event, pod, GPU, the entry its
    cause lies in): what a violation of ``verify`` is to be read with."""
    seq_of_id: dict[str, int] = {}
    lines = [f"log entries {seq - before}..{seq + after} around {seq}:"]
    for entry in entries:
        if isinstance(entry, StoredEvent):
            seq_of_id.setdefault(entry.envelope.id, entry.seq)
        if not seq - before <= entry.seq <= seq + after:
            continue
        if not isinstance(entry, StoredEvent):
            lines.append(f"{entry.seq:5} {entry.subject} unreadable: {entry.error}")
            continue
        event = entry.envelope.event
        details = " ".join(
            f"{name}={getattr(event, name)}"
            for name in ("gpu_index", "reason", "exit_code")
            if getattr(event, name, None) is not None
        )
        cause = entry.envelope.causation_id
        lines.append(
            f"{entry.seq:5}.{entry.index} {writer_of_subject(entry.subject) or '-'} "
            f"{type(event).__name__} {getattr(event, 'pod', '')} {details} "
            f"{entry.envelope.time:%H:%M:%S.%f} cause={seq_of_id.get(cause, cause or '-')}"
        )
    return "\n".join(lines)


async def test_every_client_is_told_its_true_outcome_through_50_random_kills(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(MARKER, TOKEN)  # inherited by every process started from here on
    rng = random.Random(SEED)
    faults: Counter[str] = Counter()
    skipped: Counter[str] = Counter()
    draws = 0
    chaos_s = 0.0
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
                told[pod].append(await run_client(stack.socket_path, pod, ran, run, code))

        async def keep_up(name: str) -> None:
            """Restart the service whenever it dies (as gpupool up does), at once."""
            while True:
                process = stack.services[name].process
                if process is not None:
                    await process.wait()
                with suppress(Exception):  # (it may die again while starting: next round)
                    await stack.restart(name)

        # the scan that looks for leftovers sees what the test started
        seen = marked_processes()
        started_pids = {nats.pid()} | {
            s.process.pid for s in stack.services.values() if s.process is not None
        }
        assert len(started_pids) == 1 + len(SERVICES), started_pids
        assert started_pids <= seen.keys(), (started_pids, seen)

        def enough() -> bool:
            return sum(faults.values()) >= FAULTS and all(
                faults[t] >= MIN_KILLS_PER_TARGET for t in TARGETS
            )

        loops = [asyncio.create_task(pod_loop(pod)) for pod in runs]
        keepers = [asyncio.create_task(keep_up(name)) for name in SERVICES]
        try:
            chaos_started = time.monotonic()
            while (
                not enough()
                and draws < MAX_DRAWS
                and time.monotonic() - chaos_started < CHAOS_DEADLINE_S
            ):
                draws += 1
                await asyncio.sleep(rng.uniform(0.3, 0.9))  # the seeded pause between faults
                short = [t for t in TARGETS if faults[t] < MIN_KILLS_PER_TARGET]
                target = rng.choice(short or TARGETS)
                if target == "nats-server":
                    killed = await nats.kill()
                    await nats.start()
                else:
                    killed = await kill_service(stack.services[target])
                if killed:
                    faults[target] += 1
                else:
                    skipped[target] += 1
            chaos_s = time.monotonic() - chaos_started
            chaos_over.set()
            async with asyncio.timeout(DRAIN_TIMEOUT_S):
                await asyncio.gather(*loops)
        finally:
            for keeper in keepers:
                keeper.cancel()
            await asyncio.gather(*keepers, return_exceptions=True)
            for loop in loops:
                loop.cancel()
        for name in SERVICES:
            if not stack.services[name].running:
                await stack.restart(name)
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
        f"\nchaos: {sum(faults.values())} faults ({dict(sorted(faults.items()))}) in "
        f"{draws} draws (skipped, target down: {dict(sorted(skipped.items()))}), "
        f"{sum(len(r) for r in runs.values())} runs, outcomes {dict(outcomes)}, "
        f"chaos {chaos_s:.0f}s of {elapsed:.0f}s"
    )
    assert enough(), (
        f"gave up after {draws} draws, {chaos_s:.0f}s, with {sum(faults.values())} real SIGKILLs "
        f"({dict(faults)}); wanted {FAULTS}, and {MIN_KILLS_PER_TARGET} of each of {TARGETS}"
    )
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
            and e.envelope.event.pod.name == pod  # type: ignore[union-attr]
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
    for violation in report.violations[:3]:
        print(log_window(entries, violation.seq))  # shown with the failure
    assert report.ok, report.violations[:3]
    left = await leftovers()
    assert left == {}, f"processes of the test still alive after it stopped: {left}"
