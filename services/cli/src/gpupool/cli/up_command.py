"""``gpupool up``: a NATS server (unless --nats) and all four services on this machine."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from pathlib import Path

from gpupool.cli.local_stack import StackSettings, local_stack


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "gpupool"


async def up(args: argparse.Namespace) -> int:
    settings = StackSettings(
        cluster_file=args.cluster,
        node=args.node_name,
        state_dir=args.state_dir,
        nats_url=args.nats,
        simulate_gpus=args.simulate_gpus,
        ports={"policy": 9101, "admission-queue": 9102, "preemption": 9103, "node-executor": 9104}
        if not args.any_ports
        else {},
    )
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with local_stack(settings) as stack:
        print(f"gpupool is up. NATS: {stack.nats_url} (data in {settings.state_dir / 'nats'})")
        if args.simulate_gpus:
            print(
                f"GPUs: {args.simulate_gpus} SIMULATED GPUs on {args.node_name} (--simulate-gpus)"
            )
        for name, service in stack.services.items():
            print(f"  {name:<16} http://127.0.0.1:{service.port}/metrics  log: {service.log_path}")
        print(f"Workloads: gpupool run --socket {stack.socket_path} --pod NAME -- CMD ...")
        print("Ctrl-C stops everything.", flush=True)
        await stop.wait()
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("up", help="start NATS and the four services locally")
    parser.add_argument(
        "--cluster",
        type=Path,
        required=True,
        help="nodes and pods (scenario format; see docs/scenarios.md)",
    )
    parser.add_argument("--node-name", required=True, help="the node this machine is")
    parser.add_argument("--nats", help="use this NATS server instead of starting one")
    parser.add_argument("--state-dir", type=Path, default=default_state_dir())
    parser.add_argument(
        "--simulate-gpus",
        type=int,
        metavar="N",
        help="N SIMULATED GPUs (no NVML); said so in the output and the metrics",
    )
    parser.add_argument("--any-ports", action="store_true", help="free ports instead of 9101-9104")
    parser.set_defaults(handler=lambda args: asyncio.run(up(args)))
