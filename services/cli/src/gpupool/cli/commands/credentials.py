"""``gpupool credentials generate``: the NATS users, their permissions and TLS for a deployment."""

from __future__ import annotations

import argparse
from pathlib import Path

from gpupool.cli.exits import EXIT_OK, InvalidInput
from gpupool.cli.main import Subparsers
from gpupool.eventlog.credentials import (
    AUTH_CONFIG,
    DEFAULT_STREAM,
    DEFAULT_TLS_NAMES,
    write_credentials,
)
from gpupool.eventlog.subjects import DEFAULT_SUBJECT_PREFIX


def register(subparsers: Subparsers) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "credentials",
        help="generate the NATS users, permissions and TLS certificates of a deployment",
        description="Credentials for an authenticated NATS (docs/security.md).",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    generate = actions.add_parser(
        "generate",
        help="write nats-auth.conf, one nkey seed per service and node, a CA and a server "
        "certificate",
        description=f"Write into DIR: {AUTH_CONFIG} (the nats-server authorization block: "
        "one nkey user per service, each allowed to append only on its own subjects), "
        "<user>.nk (each user's seed: policy, admission-queue, preemption, "
        "node-executor-<node> for each --node, reader, stream-admin, operator: the person's, "
        "the only one that may purge the stream, for `gpupool log purge`), users.json (the "
        "public keys and permissions), and unless --no-tls ca.pem, ca-key.pem, server.pem, "
        "server-key.pem. Seeds and keys are written mode 0600. Generating again makes new "
        "keys: replace every file of the deployment together.",
    )
    generate.add_argument("--out", type=Path, required=True, metavar="DIR")
    generate.add_argument(
        "--node",
        action="append",
        default=[],
        metavar="NAME",
        help="a GPU node: its executor gets a user that appends for this node only (repeat)",
    )
    generate.add_argument("--stream", default=DEFAULT_STREAM)
    generate.add_argument("--subject-prefix", default=DEFAULT_SUBJECT_PREFIX)
    generate.add_argument(
        "--tls-name",
        action="append",
        default=None,
        metavar="NAME",
        help="a DNS name or IP address of the NATS server for its certificate (repeat; "
        f"default: {', '.join(DEFAULT_TLS_NAMES)})",
    )
    generate.add_argument("--no-tls", action="store_true", help="no CA nor certificate")
    generate.set_defaults(handler=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    names = None if args.no_tls else tuple(args.tls_name or DEFAULT_TLS_NAMES)
    try:
        generated = write_credentials(
            args.out,
            nodes=args.node,
            stream=args.stream,
            prefix=args.subject_prefix,
            tls_names=names,
        )
    except ValueError as exc:
        raise InvalidInput(str(exc)) from exc
    print(f"wrote {generated.auth_config}")
    for user, path in generated.seeds.items():
        print(f"  {user:<32} {generated.public_keys[user]}  {path}")
    if generated.tls:
        print(f"  TLS: {args.out}/ca.pem, server.pem, server-key.pem (ca-key.pem: keep it safe)")
    return EXIT_OK
