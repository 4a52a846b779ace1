"""python -m gpupool.node_executor: the node-executor service (one per GPU node)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from gpupool.gpus import (
    GpuSampler,
    Inventory,
    NvmlSampler,
    NvmlUnavailable,
    SimulatedSampler,
    discover_nvml,
    simulated_inventory,
)
from gpupool.node_executor.service import NodeExecutor
from gpupool.runtime.metrics import executor_registry
from gpupool.runtime.service import add_common_arguments, common_options, run_service, serve

DEFAULT_SOCKET = "/run/gpupool/gpupool.sock"


def choose_inventory(
    node: str, simulate_gpus: int | None, memory_mib: int
) -> tuple[Inventory, GpuSampler]:
    """Real GPUs from NVML; simulated ones only when asked for, and then said loudly."""
    if simulate_gpus is not None:
        inventory = simulated_inventory(simulate_gpus, node=node, memory_mib=memory_mib)
        print(
            f"gpupool node-executor: SIMULATED GPUs on {node} (asked for with --simulate-gpus): "
            f"{inventory.describe()}",
            file=sys.stderr,
            flush=True,
        )
        return inventory, SimulatedSampler(inventory)
    try:
        inventory = discover_nvml()
    except NvmlUnavailable as error:
        print(
            f"gpupool node-executor: no GPUs: NVML is unavailable ({error.reason}). "
            "Refusing to start. To run without GPUs for testing, pass --simulate-gpus N "
            "(the inventory is then reported as simulated).",
            file=sys.stderr,
        )
        raise SystemExit(3) from error
    return inventory, NvmlSampler(inventory)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m gpupool.node_executor", description=__doc__)
    add_common_arguments(parser, default_port=9104)
    parser.add_argument(
        "--node-name",
        default=os.environ.get("GPUPOOL_NODE_NAME"),
        help="this node's name (env GPUPOOL_NODE_NAME; in Kubernetes: spec.nodeName)",
    )
    parser.add_argument(
        "--socket",
        type=Path,
        default=Path(os.environ.get("GPUPOOL_SOCKET", DEFAULT_SOCKET)),
        help=f"Unix socket for workloads (env GPUPOOL_SOCKET; default {DEFAULT_SOCKET})",
    )
    parser.add_argument(
        "--simulate-gpus",
        type=int,
        metavar="N",
        help="use N SIMULATED GPUs instead of NVML (testing only; reported as simulated)",
    )
    parser.add_argument("--simulated-gpu-memory-mib", type=int, default=81559)
    parser.add_argument(
        "--message-period",
        type=float,
        help="seconds between waiting messages (default: the node's QoS, 10 s)",
    )
    args = parser.parse_args()
    if not args.node_name:
        parser.error("--node-name (or GPUPOOL_NODE_NAME) is required")
    if args.simulate_gpus is not None and args.simulate_gpus < 1:
        parser.error("--simulate-gpus must be at least 1")
    inventory, sampler = choose_inventory(
        args.node_name, args.simulate_gpus, args.simulated_gpu_memory_mib
    )
    args.socket.parent.mkdir(parents=True, exist_ok=True)
    service = NodeExecutor(
        node=args.node_name,
        inventory=inventory,
        socket_path=args.socket,
        sampler=sampler,
        message_period_seconds=args.message_period,
    )

    async def run(stop: asyncio.Event) -> None:
        await run_service(
            service,
            common_options(args),
            stop,
            registry_factory=lambda projection: executor_registry(projection, service),
        )

    serve(run, log_level=args.log_level)


if __name__ == "__main__":
    main()
