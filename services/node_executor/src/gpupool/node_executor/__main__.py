"""python -m gpupool.node_executor: the node-executor service (one per GPU node)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from gpupool.node_executor.hook_install import install_cuda_hook
from gpupool.node_executor.inventory import (
    ExecutorReadings,
    NoGpuInventory,
    sampler_for,
    select_inventory,
)
from gpupool.node_executor.pod_owners import PodOwners
from gpupool.node_executor.processes import ProcessSupervisor
from gpupool.node_executor.service import DEFAULT_REATTACH_SECONDS, NodeExecutor
from gpupool.observability.service_metrics import executor_registry
from gpupool.runtime.service import add_common_arguments, common_options, run_service, serve

DEFAULT_SOCKET = "/run/gpupool/gpupool.sock"
DEFAULT_STATE_DIR = "/var/lib/gpupool/node-executor"


def main() -> None:
    env = os.environ.get
    parser = argparse.ArgumentParser(prog="python -m gpupool.node_executor", description=__doc__)
    add_common_arguments(parser, default_port=9104)
    parser.add_argument(
        "--node-name",
        default=env("GPUPOOL_NODE_NAME"),
        help="this node's name (env GPUPOOL_NODE_NAME; in Kubernetes: spec.nodeName)",
    )
    parser.add_argument(
        "--socket",
        type=Path,
        default=Path(env("GPUPOOL_SOCKET", DEFAULT_SOCKET)),
        help=f"Unix socket for workloads (env GPUPOOL_SOCKET; default {DEFAULT_SOCKET})",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=Path(env("GPUPOOL_STATE_DIR", DEFAULT_STATE_DIR)),
        help="workload records that let a restarted executor adopt running jobs",
    )
    parser.add_argument(
        "--reattach-seconds",
        type=float,
        default=DEFAULT_REATTACH_SECONDS,
        help="after a restart, how long a waiting pod keeps its place for its client",
    )
    parser.add_argument(
        "--identity",
        choices=("kernel", "request"),
        default=env("GPUPOOL_IDENTITY", "request"),
        help="kernel: a caller acts only for the pod its cgroup names (Kubernetes); "
        "request: for the pod it names (local mode)",
    )
    parser.add_argument(
        "--cluster",
        type=Path,
        default=Path(cluster) if (cluster := env("GPUPOOL_CLUSTER_FILE")) else None,
        help="local mode: the cluster file that names each pod's owner (its owner_uid, else "
        "the file's owner); other users are refused (env GPUPOOL_CLUSTER_FILE)",
    )
    parser.add_argument(
        "--run-in",
        choices=("caller", "executor"),
        help="where commands run: in the caller's namespaces (its pod's container; the default "
        "with --identity kernel) or in the executor's (the default in local mode)",
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
    parser.add_argument(
        "--install-cuda-hook",
        nargs=2,
        type=Path,
        metavar=("LIBRARY", "DIRECTORY"),
        help="copy the CUDA hook LIBRARY into the host DIRECTORY (atomically) before serving",
    )
    args = parser.parse_args()
    if args.install_cuda_hook is not None:
        try:
            installed = install_cuda_hook(*args.install_cuda_hook)
        except OSError as error:  # the executor still serves `gpupool run`; hooked pods fail closed
            print(
                f"gpupool node-executor: ERROR: cannot install the CUDA hook: {error}; pods "
                "given the hook by the webhook will not start on this node (their hostPath "
                "file is missing)",
                file=sys.stderr,
            )
        else:
            print(f"gpupool node-executor: CUDA hook installed at {installed}", file=sys.stderr)
    if not args.node_name:
        parser.error("--node-name (or GPUPOOL_NODE_NAME) is required")
    if args.simulate_gpus is not None and args.simulate_gpus < 1:
        parser.error("--simulate-gpus must be at least 1")
    try:
        inventory = select_inventory(
            node=args.node_name,
            simulate_gpus=args.simulate_gpus,
            simulated_memory_mib=args.simulated_gpu_memory_mib,
        )
    except NoGpuInventory as error:
        print(f"gpupool node-executor: {error}", file=sys.stderr)
        raise SystemExit(3) from error
    if inventory.simulated:
        print(
            f"gpupool node-executor: SIMULATED GPUs: {inventory.describe()}",
            file=sys.stderr,
            flush=True,
        )
    args.socket.parent.mkdir(parents=True, exist_ok=True)
    service = NodeExecutor(
        node=args.node_name,
        inventory=inventory,
        socket_path=args.socket,
        sampler=sampler_for(inventory),
        supervisor=ProcessSupervisor(records_dir=args.state_dir / "workloads"),
        message_period_seconds=args.message_period,
        reattach_seconds=args.reattach_seconds,
        identity=args.identity,
        pod_owners=PodOwners(args.cluster),
        run_in_caller_namespaces=(
            args.run_in or ("caller" if args.identity == "kernel" else "executor")
        )
        == "caller",
    )

    readings = ExecutorReadings(
        args.node_name,
        inventory,
        service.sampler,
        service.pod_processes,
        pod_processes_among=service.pod_processes,  # the scrape's sampled pids only
    )

    async def run(stop: asyncio.Event) -> None:
        await run_service(
            service,
            common_options(args),
            stop,
            registry_factory=lambda projection: executor_registry(projection, readings),
            partition=args.node_name,  # its own node's entries only
        )

    serve(run, log_level=args.log_level)


if __name__ == "__main__":
    main()
