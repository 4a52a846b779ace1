"""`gpupool up`: a NATS server (unless --nats) and the four services on this machine, supervised.

* Every port is checked before anything starts: a taken one ends `gpupool up` with exit
  status 1 and names the port and what it was for.
* A service that exits is restarted, with backoff (1 s, doubling to 30 s; reset
  once it has run a minute), and each restart is reported on stdout.
* Ctrl-C (or SIGTERM) stops the deciders first, then the node-executor (which ends
  the running jobs, records their end and tells their clients), then the policy,
  NATS last. The services run in their own process groups, so the terminal's
  Ctrl-C reaches only `gpupool up`.
* Its NATS URL goes into <state dir>/up.json, where the other gpupool
  commands find it (GPUPOOL_NATS_URL wins over it).
* Pods can be added while it runs: `gpupool pod add` (or any edit of the
  cluster file; the policy reads it again when it changes).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
import time
from contextlib import suppress
from pathlib import Path

from gpupool.cli.exits import EXIT_FAILURE, EXIT_OK
from gpupool.cli.local_stack import StackFailed, StackSettings, local_stack
from gpupool.cli.stack_address import (
    UP_FILE,
    RunningStack,
    default_state_dir,
    read_running_stack,
    write_running_stack,
)
from gpupool.eventlog.nats_server import NatsServerError

DEFAULT_PORTS = {"policy": 9101, "admission-queue": 9102, "preemption": 9103, "node-executor": 9104}
DEFAULT_NATS_PORT = 4222


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return True
    return False


def taken_ports(wanted: dict[str, int]) -> list[str]:
    return [f"port {port} ({what})" for what, port in wanted.items() if port and port_in_use(port)]


def say(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} gpupool up: {text}", flush=True)


def up(args: argparse.Namespace) -> int:
    """Check what can be checked before anything starts; then run the stack until stopped."""
    state_dir: Path = args.state_dir
    running = read_running_stack(state_dir)
    if running is not None:
        print(
            f"gpupool up: already running (pid {running.pid}, NATS {running.nats_url}); "
            f"its state is in {state_dir}",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    ports = {} if args.any_ports else dict(DEFAULT_PORTS)
    nats_port = -1 if args.any_ports else args.nats_port
    wanted = {f"{name} /metrics": port for name, port in ports.items()}
    if args.nats is None and nats_port > 0:
        wanted["NATS"] = nats_port
    taken = taken_ports(wanted)
    if taken:
        print(
            f"gpupool up: {', '.join(taken)} already in use on 127.0.0.1; stop what listens "
            "there, or use --any-ports (or --nats-port)",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    settings = StackSettings(
        cluster_file=args.cluster.resolve(),
        node=args.node_name,
        state_dir=state_dir,
        nats_url=args.nats,
        nats_port=nats_port,
        simulate_gpus=args.simulate_gpus,
        message_period=args.message_period,
        ports=ports,
    )
    state_dir.mkdir(parents=True, exist_ok=True)
    return asyncio.run(run_stack(args, settings))


async def run_stack(args: argparse.Namespace, settings: StackSettings) -> int:
    state_dir = settings.state_dir
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with local_stack(settings) as stack:
            address = write_running_stack(
                state_dir,
                RunningStack(
                    nats_url=stack.nats_url,
                    cluster_file=str(settings.cluster_file),
                    node=settings.node,
                    socket=str(stack.socket_path),
                    pid=os.getpid(),
                ),
            )
            print(f"gpupool is up. NATS: {stack.nats_url} (data in {state_dir / 'nats'})")
            print(f"  the gpupool commands find it in {address} (GPUPOOL_NATS_URL overrides it)")
            if args.simulate_gpus:
                print(
                    f"GPUs: {args.simulate_gpus} SIMULATED GPUs on {args.node_name} "
                    "(--simulate-gpus)"
                )
            for name, service in stack.services.items():
                print(
                    f"  {name:<16} http://127.0.0.1:{service.port}/metrics  log: {service.log_path}"
                )
            print(f"Workloads: gpupool run --socket {stack.socket_path} --pod NAME -- CMD ...")
            print(f"New pods: gpupool pod add NAME ... (or edit {settings.cluster_file})")
            print("Ctrl-C stops everything.", flush=True)
            supervisor = asyncio.create_task(stack.supervise(say))
            try:
                await stop.wait()
            finally:
                say("stopping: admission-queue and preemption, then node-executor, policy, NATS")
                stack.stopping = True
                supervisor.cancel()
                with suppress(asyncio.CancelledError):
                    await supervisor
                (state_dir / UP_FILE).unlink(missing_ok=True)
        say("stopped")
    except (StackFailed, NatsServerError) as failure:
        (state_dir / UP_FILE).unlink(missing_ok=True)
        print(f"gpupool up: {failure}", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "up",
        help="start NATS and the four services locally, supervised",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--cluster",
        type=Path,
        required=True,
        help="nodes and pods (scenario format; see docs/scenarios.md); read again on change",
    )
    parser.add_argument("--node-name", required=True, help="the node this machine is")
    parser.add_argument("--nats", help="use this NATS server instead of starting one")
    parser.add_argument(
        "--nats-port",
        type=int,
        default=DEFAULT_NATS_PORT,
        help=f"port of the NATS server it starts (default {DEFAULT_NATS_PORT})",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=default_state_dir(),
        help="NATS data, logs, snapshots, up.json (env GPUPOOL_STATE_DIR; "
        "default $XDG_STATE_HOME/gpupool)",
    )
    parser.add_argument(
        "--simulate-gpus",
        type=int,
        metavar="N",
        help="N SIMULATED GPUs (no NVML); said so in the output and the metrics",
    )
    parser.add_argument(
        "--message-period",
        type=float,
        metavar="SECONDS",
        help="seconds between waiting messages (default: the node's QoS, 10 s)",
    )
    parser.add_argument(
        "--any-ports", action="store_true", help="free ports instead of 9101-9104 and 4222"
    )
    parser.set_defaults(handler=up)
