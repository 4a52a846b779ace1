"""python -m gpupool.policy: the policy service (local cluster file or Kubernetes)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from gpupool.core import Rejection, parse_qos_annotation
from gpupool.core.validation import QOS_ANNOTATION
from gpupool.kube.adapter import KubernetesAsyncioApi
from gpupool.policy.local_config import ConfigError, LocalCluster, load_local_cluster
from gpupool.policy.service import PolicyService
from gpupool.runtime.service import add_common_arguments, common_options, run_service, serve

DEFAULT_QOS_ENV = "GPUPOOL_DEFAULT_QOS_CONFIG"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m gpupool.policy", description=__doc__)
    add_common_arguments(parser, default_port=9101)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--cluster",
        type=Path,
        help="local mode: nodes and pods from this YAML file (read again when it changes: "
        "new pods are registered, changed nodes configured again)",
    )
    source.add_argument(
        "--kubernetes",
        action="store_true",
        help="watch the Kubernetes API (in-cluster, --kubeconfig or --kube-server)",
    )
    parser.add_argument("--kubeconfig", help="with --kubernetes: this kubeconfig file")
    parser.add_argument(
        "--kube-server", help="with --kubernetes: this API URL without credentials (kubectl proxy)"
    )
    parser.add_argument(
        "--default-qos-config",
        default=os.environ.get(DEFAULT_QOS_ENV) or None,
        metavar="JSON",
        help="with --kubernetes: the QoS of a GPU-sharing node that carries no "
        f"{QOS_ANNOTATION} annotation, in that annotation's format (env {DEFAULT_QOS_ENV}; "
        "default: none, so such a node does not preempt)",
    )
    args = parser.parse_args()
    if args.default_qos_config is not None:
        checked = parse_qos_annotation(args.default_qos_config)
        if isinstance(checked, Rejection):
            print(f"gpupool policy: --default-qos-config: {checked.message}", file=sys.stderr)
            raise SystemExit(2)
    cluster: LocalCluster | None = None
    if args.cluster is not None:
        try:
            cluster = load_local_cluster(args.cluster)
        except ConfigError as exc:
            print(f"gpupool policy: {exc}", file=sys.stderr)
            raise SystemExit(2) from exc

    async def connect() -> KubernetesAsyncioApi:
        return await KubernetesAsyncioApi.connect(host=args.kube_server, kubeconfig=args.kubeconfig)

    service = PolicyService(
        cluster,
        kubernetes=connect if args.kubernetes else None,
        cluster_file=args.cluster,
        default_qos=args.default_qos_config,
    )

    async def run(stop: asyncio.Event) -> None:
        await run_service(
            service, common_options(args), stop, projection_factory=service.projection
        )

    serve(run, log_level=args.log_level)


if __name__ == "__main__":
    main()
