"""PodReady -> Assigned latency through all four services, against the raw JetStream round trip.

Starts the local stack (real nats-server, the four services as processes, 8 SIMULATED
GPUs), then runs workloads through the node-executor's socket exactly as `gpupool run`
does (in-process clients; each command is a real `true` process). Latency is PodReady
stored -> Assigned stored: the server's own store time of each entry (JetStream's
message timestamp); the log's envelope times (each decider's clock when it decided) split
it: PodReady stored -> the admission-queue deciding -> its Assigned stored. The
baseline, measured in the same run on the same server: one JetStream publish -> the same
message arriving at an ordered consumer, 1,000 back to back before the workloads start
(the machine as idle as it gets). Beside it, the same round trip *during* the run: a
process of its own (as each service is) times one round trip every
:data:`DURING_EVERY_S`, so the baseline meets the same load as the placements; both
ratios are printed. Then where the machine's CPU went during the run: each service's
CPU seconds, the nats-server's, the whole machine's, the kernel's CPU pressure (the
share of the run during which some runnable task waited for a core), and each
process's time spent runnable but waiting for a core (``/proc/<pid>/task/*/schedstat``:
the scheduler's run-queue wait, every thread), in all and per time slice it got, and its
wake-ups (voluntary context switches, every thread) with its time on a core per wake-up; and
what each process spends idle (its CPU over :data:`IDLE_S` after the run), so the rest
can be put per log entry. The raw round trip's own process is in the wait table too: its
time on a core per wake-up is what a wake-up costs, on this machine under this load, a
Python process with a small fixed job (nats-py's own JetStream publish and one delivery
to an ordered consumer per round trip), to set the services' own per wake-up against.
Prints tables; asserts nothing.

    python bench/bench_services.py [--pods 200] [--gpus 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import nats
from nats.aio.msg import Msg

from gpupool.cli.local_stack import StackSettings, local_stack
from gpupool.eventlog.jetstream import JetStreamEventLog
from gpupool.eventlog.port import StoredEvent
from gpupool.events import Assigned, PodReady, PodRef
from gpupool.workload import Rejected, RunRequest
from gpupool.workload.client import run_workload

NODE = "bench-node"


def cluster_yaml(pods: int, gpus: int) -> str:
    lines = [
        "nodes:",
        f"  - {{name: {NODE}, gpus: {gpus}, policy: share-pool}}",
        "pods:",
    ]
    for i in range(pods):
        lines.append(
            f"  - {{name: p{i:04d}, node: {NODE}, requests: {{core: 1, memory: 1}}, "
            "limits: {core: 50, memory: 50}}"
        )
    return "\n".join(lines) + "\n"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


async def raw_round_trip(url: str, count: int) -> list[float]:
    """Publish to a JetStream stream and time the arrival at an ordered consumer."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.add_stream(name="BENCH_RTT", subjects=["bench.rtt"])
    arrived: asyncio.Queue[float] = asyncio.Queue()

    async def on_msg(msg: object) -> None:
        arrived.put_nowait(time.perf_counter())

    await js.subscribe("bench.rtt", cb=on_msg, ordered_consumer=True)
    samples = []
    for _ in range(count):
        sent = time.perf_counter()
        await js.publish("bench.rtt", b"x")
        samples.append((await arrived.get()) - sent)
    await nc.close()
    return samples


SETTLE_S = 0.5
IDLE_S = 2.0
"""After the run (and SETTLE_S): each process's CPU with nothing to do (its threads' time on a core,
nanoseconds, not the 10 ms ticks of ``/proc/<pid>/stat``), measured for this long."""

DURING_EVERY_S = 0.02
"""The pause between two round trips of the in-run baseline (about 1 % of a core)."""

DURING = r"""
import asyncio, json, sys, time
import nats

async def main(url):
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.add_stream(name="BENCH_RTT_RUN", subjects=["bench.rtt.run"])
    arrived = asyncio.Queue()

    async def on_msg(msg):
        arrived.put_nowait(time.perf_counter())

    await js.subscribe("bench.rtt.run", cb=on_msg, ordered_consumer=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_reader(sys.stdin.fileno(), stop.set)
    print("ready", flush=True)
    samples = []
    while not stop.is_set():
        sent = time.perf_counter()
        await js.publish("bench.rtt.run", b"x")
        samples.append(await arrived.get() - sent)
        try:
            async with asyncio.timeout(float(sys.argv[2])):
                await stop.wait()
        except TimeoutError:
            pass
    print(json.dumps(samples), flush=True)
    await nc.close()

asyncio.run(main(sys.argv[1]))
"""
"""The in-run baseline's process: raw round trips, paced, until a line on its stdin."""


class DuringRun:
    """The raw round trip timed in a process of its own while the workloads run."""

    def __init__(self) -> None:
        self.process: asyncio.subprocess.Process | None = None

    async def start(self, url: str) -> None:
        self.process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            DURING,
            url,
            str(DURING_EVERY_S),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert self.process.stdout is not None
        await self.process.stdout.readline()  # subscribed

    async def stop(self) -> list[float]:
        assert self.process is not None
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(b"stop\n")
        await self.process.stdin.drain()
        samples: list[float] = json.loads(await self.process.stdout.readline())
        await self.process.wait()
        return samples


async def stored_times(url: str, stream: str, prefix: str) -> dict[int, float]:
    """Every entry's store time (JetStream's message timestamp, wall clock), by sequence."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    info = await js.stream_info(stream)
    last = info.state.last_seq
    times: dict[int, float] = {}
    done = asyncio.Event()

    async def on_msg(msg: Msg) -> None:
        meta = msg.metadata
        times[meta.sequence.stream] = meta.timestamp.timestamp()
        if meta.sequence.stream >= last:
            done.set()

    subscription = await js.subscribe(
        f"{prefix}.>", stream=stream, cb=on_msg, ordered_consumer=True
    )
    async with asyncio.timeout(60):
        await done.wait()
    await subscription.unsubscribe()
    await nc.close()
    return times


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(its own, its waited-for children's) CPU seconds, user + system, of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    hz = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / hz, (int(fields[13]) + int(fields[14])) / hz


def run_queue_wait(pid: int) -> tuple[float, float, int, int]:
    """(on a core, runnable but waiting for one) seconds, time slices and wake-ups (voluntary
    context switches: sleeps that ended) so far, summed over the process's threads
    (``/proc/<pid>/task/*/schedstat`` and ``status``); exited threads are not counted."""
    on_cpu = waited = 0.0
    slices = wakes = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            run_ns, wait_ns, count = (task / "schedstat").read_text().split()
            status = (task / "status").read_text()
        except (OSError, ValueError):
            continue
        on_cpu += int(run_ns) / 1e9
        waited += int(wait_ns) / 1e9
        slices += int(count)
        wakes += next(
            int(line.split()[1])
            for line in status.splitlines()
            if line.startswith("voluntary_ctxt_switches:")
        )
    return on_cpu, waited, slices, wakes


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far (/proc/stat)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = values[3] + values[4]
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(values) - idle) / hz, sum(values) / hz


def cpu_pressure() -> float:
    """Seconds during which some runnable task waited for a CPU (PSI), so far; nan: none."""
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except OSError:
        return float("nan")
    return int(line.rsplit("total=", 1)[1]) / 1e6


def nats_server_pid() -> int | None:
    """The nats-server this process started (its child, by command name)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            head, _, rest = stat.read_text().rpartition(")")
        except OSError:
            continue
        if head.endswith("(nats-server") and int(rest.split()[1]) == os.getpid():
            return int(stat.parent.name)
    return None


async def run_pods(socket: Path, pods: int, concurrency: int) -> None:
    devnull = os.open(os.devnull, os.O_RDWR)
    semaphore = asyncio.Semaphore(concurrency)

    async def one(index: int) -> int:
        async with semaphore:
            request = RunRequest(
                pod=PodRef(namespace="default", name=f"p{index:04d}"),
                argv=["true"],
                cwd="/",
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            )
            return await run_workload(
                socket, request, on_message=note, fds=(devnull, devnull, devnull)
            )

    rejections: list[str] = []

    def note(message: object) -> None:
        if isinstance(message, Rejected):
            rejections.append(f"{message.reason}: {message.message}")

    codes = await asyncio.gather(*(one(i) for i in range(pods)))
    os.close(devnull)
    failed = [c for c in codes if c != 0]
    if failed:
        print(f"warning: {len(failed)} runs did not exit 0: {rejections[:3]}", file=sys.stderr)


async def main(pods: int, gpus: int, concurrency: int) -> None:
    with tempfile.TemporaryDirectory(prefix="gpupool-bench-") as tmp:
        cluster = Path(tmp) / "cluster.yaml"
        cluster.write_text(cluster_yaml(pods, gpus))
        settings = StackSettings(
            cluster_file=cluster,
            node=NODE,
            state_dir=Path(tmp) / "state",
            simulate_gpus=gpus,
            log_level="WARNING",
        )
        async with local_stack(settings) as stack:
            baseline = await raw_round_trip(stack.nats_url, 1000)
            pids = {  # the node-executor's figure includes its reaped `true` processes
                name: service.process.pid
                for name, service in stack.services.items()
                if service.process is not None
            }
            server_pid = nats_server_pid()
            if server_pid is not None:
                pids["nats-server"] = server_pid
            pids["bench (the 16 clients)"] = os.getpid()
            during = DuringRun()
            await during.start(stack.nats_url)
            cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
            assert during.process is not None
            # the raw round trip's process: what a wake-up costs a process with a small fixed job
            watched = {**pids, "raw round trip's process": during.process.pid}
            waits_before = {name: run_queue_wait(pid) for name, pid in watched.items()}
            busy_before, pressure_before = machine_busy(), cpu_pressure()
            started = time.perf_counter()
            await run_pods(stack.socket_path, pods, concurrency)
            elapsed = time.perf_counter() - started
            busy_after, pressure_after = machine_busy(), cpu_pressure()
            waits = {
                name: tuple(
                    after - before
                    for after, before in zip(run_queue_wait(pid), waits_before[name], strict=True)
                )
                for name, pid in watched.items()
            }
            during_run = await during.stop()
            await asyncio.sleep(SETTLE_S)  # the last releases folded everywhere
            idle_before = {name: run_queue_wait(pid)[0] for name, pid in pids.items()}
            await asyncio.sleep(IDLE_S)  # what each process costs with nothing to do
            idle = {
                name: (run_queue_wait(pid)[0] - idle_before[name]) / IDLE_S
                for name, pid in pids.items()
            }
            cpu = {
                name: tuple(
                    after - before
                    for after, before in zip(cpu_seconds(pid), cpu_before[name], strict=True)
                )
                for name, pid in pids.items()
            }
            log = await JetStreamEventLog.connect(stack.nats_url)
            entries = [e async for e in log.replay()]
            stream, prefix = log.stream, log.subject_prefix
            await log.close()
            stored = await stored_times(stack.nats_url, stream, prefix)
    ready: dict[PodRef, tuple[float, float]] = {}
    latencies: list[float] = []
    to_decision: list[float] = []
    to_store: list[float] = []
    executor_publish: list[float] = []
    assigned_times: list[float] = []
    for entry in entries:
        if not isinstance(entry, StoredEvent):
            continue
        event, when = entry.envelope.event, entry.envelope.time.timestamp()
        at = stored.get(entry.seq, float("nan"))
        if isinstance(event, PodReady):
            ready[event.pod] = (when, at)
            executor_publish.append(at - when)
        elif isinstance(event, Assigned) and event.pod in ready:
            _, ready_at = ready.pop(event.pod)
            latencies.append(at - ready_at)
            to_decision.append(when - ready_at)
            to_store.append(at - when)
            assigned_times.append(when)
    span = max(assigned_times) - min(assigned_times) if len(assigned_times) > 1 else float("nan")
    ms = 1000.0
    print(
        f"{pods} pods, {gpus} simulated GPUs, {concurrency} concurrent clients, limits 50% "
        f"(2 per GPU), each command a real `true` process; {os.cpu_count()} CPUs\n"
    )
    print(f"{'measure':<44}{'p50 ms':>10}{'p99 ms':>10}{'mean ms':>10}")
    rows = [
        ("raw JetStream publish -> ordered consumer", baseline),
        ("  the same during the run (its own process)", during_run),
        ("PodReady stored -> Assigned stored", latencies),
        ("  PodReady stored -> admission-queue decides", to_decision),
        ("  admission-queue decides -> Assigned stored", to_store),
        ("(executor decides -> PodReady stored)", executor_publish),
    ]
    for name, values in rows:
        print(
            f"{name:<44}{percentile(values, 0.5) * ms:>10.2f}{percentile(values, 0.99) * ms:>10.2f}"
            f"{statistics.fmean(values) * ms:>10.2f}"
        )
    ratio = percentile(latencies, 0.5) / percentile(baseline, 0.5)
    ratio99 = percentile(latencies, 0.99) / percentile(baseline, 0.99)
    print(
        f"\nratio PodReady stored -> Assigned stored / raw round trip: p50 {ratio:.1f}x, "
        f"p99 {ratio99:.1f}x"
    )
    print(
        "ratio against the round trip during the run: p50 "
        f"{percentile(latencies, 0.5) / percentile(during_run, 0.5):.1f}x, p99 "
        f"{percentile(latencies, 0.99) / percentile(during_run, 0.99):.1f}x "
        f"({len(during_run)} round trips)"
    )
    busy = busy_after[0] - busy_before[0]
    capacity = busy_after[1] - busy_before[1]
    pressure = pressure_after - pressure_before
    print(f"\nCPU during the run ({elapsed:.2f} s wall, {os.cpu_count()} CPUs):")
    for name, (own, children) in sorted(cpu.items(), key=lambda item: -sum(item[1])):
        per_event = (own - idle[name] * elapsed) / len(entries) * 1e6 if entries else 0.0
        print(
            f"  {name:<36}{own:>7.2f} cpu s ({own / elapsed:.0%} of a core; idle "
            f"{idle[name] * elapsed:.2f} of it, the rest {per_event:.0f} us per log entry)"
            + (f"; its child processes {children:.2f} cpu s" if children else "")
        )
    print(
        f"  {'whole machine (every process)':<36}{busy:>7.2f} cpu s "
        f"({busy / capacity:.0%} of its CPUs busy)"
    )
    print(
        f"  CPU pressure: some runnable task waited for a core {pressure / elapsed:.0%} of the run"
    )
    print("\nWaiting for a core (runnable, not running; the process's threads, not its children):")
    for name, (on_cpu, waited, slices, wakes) in sorted(
        waits.items(), key=lambda item: -item[1][1]
    ):
        per_slice = waited / slices * ms if slices else float("nan")
        per_wake = on_cpu / wakes * 1e6 if wakes else float("nan")
        print(
            f"  {name:<36}{waited:>7.2f} s waited ({waited / elapsed:.0%} of the run), "
            f"{on_cpu:.2f} s on a core, {int(slices)} slices: {per_slice:.2f} ms waited per slice; "
            f"{int(wakes)} wake-ups, {per_wake:.0f} us on a core per wake-up"
        )
    kinds = Counter(
        type(entry.envelope.event).__name__ for entry in entries if isinstance(entry, StoredEvent)
    )
    print(
        f"  the log: {len(entries)} entries; "
        + ", ".join(f"{name} {count}" for name, count in kinds.most_common())
    )
    print(f"placements per second (first to last Assigned): {len(assigned_times) / span:.1f}")
    print(f"whole runs per second (ready -> ran -> released, end to end): {pods / elapsed:.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=200)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument(
        "--concurrency",
        type=int,
        default=16,
        help="concurrent clients (default 16 = the capacity: nobody waits for a GPU)",
    )
    options = parser.parse_args()
    asyncio.run(main(options.pods, options.gpus, options.concurrency))
