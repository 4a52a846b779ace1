"""``gpupool console`` / ``gpupool-console``: serve the web console (loopback by default).

It reads the log read-only: ``--nats URL`` follows a live stream (an ordered consumer;
``--creds FILE`` for a NATS credential that may only read it), ``--log FILE`` shows a
JSON-lines log. It prints the address it serves on once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import uvicorn

from gpupool.console.app import create_app
from gpupool.console.feed import DEFAULT_STREAM, FileFeed, LogFeed, NatsFeed
from gpupool.eventlog.subjects import DEFAULT_SUBJECT_PREFIX

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--nats", metavar="URL", help="follow a live JetStream log")
    source.add_argument("--log", type=Path, metavar="FILE", help="show a JSON-lines log")
    parser.add_argument("--stream", default=DEFAULT_STREAM, help=f"(default {DEFAULT_STREAM})")
    parser.add_argument(
        "--subject-prefix", default=DEFAULT_SUBJECT_PREFIX, help="subjects of the log"
    )
    parser.add_argument(
        "--creds",
        type=Path,
        metavar="FILE",
        default=os.environ.get("GPUPOOL_NATS_CREDENTIALS") or None,
        help="NATS credentials that may only read the log: the reader's nkey seed file "
        "(`gpupool credentials generate`) or a .creds file (env GPUPOOL_NATS_CREDENTIALS)",
    )
    parser.add_argument(
        "--nats-ca",
        type=Path,
        metavar="FILE",
        default=os.environ.get("GPUPOOL_NATS_CA") or None,
        help="PEM of the CA that signed the NATS server's certificate (env GPUPOOL_NATS_CA)",
    )
    parser.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help=f"address to listen on (default {DEFAULT_HOST}: this machine only)",
    )
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"(default {DEFAULT_PORT}; 0: any free)"
    )


def feed_for(args: argparse.Namespace) -> LogFeed:
    if args.log is not None:
        if not args.log.is_file():
            raise SystemExit(f"gpupool console: {args.log}: no such log file")
        return FileFeed(args.log, subject_prefix=args.subject_prefix)
    return NatsFeed(
        args.nats,
        stream=args.stream,
        subject_prefix=args.subject_prefix,
        credentials=args.creds,
        tls_ca=args.nats_ca,
    )


async def serve(args: argparse.Namespace) -> None:
    listener = socket.create_server((args.host, args.port))
    host, port = listener.getsockname()[:2]

    def ready() -> None:
        # the listener is bound and listening already: connections wait in its backlog
        print(f"gpupool console: serving http://{host}:{port}/", flush=True)

    app = create_app(feed_for(args), on_ready=ready)
    server = uvicorn.Server(bounded_config(app))
    await server.serve(sockets=[listener])


MAX_CONNECTIONS = 64
"""Connections and requests at once; uvicorn answers the next ones 503."""
MAX_HEADER_BYTES = 32 * 1024
KEEP_ALIVE_SECONDS = 5


def bounded_config(app: Any) -> uvicorn.Config:
    """uvicorn, bounded against hostile clients (docs/security.md): connections at once,
    the size of a request's headers (h11 answers 400 beyond it), idle keep-alive. The
    console's routes take no body and never read one."""
    return uvicorn.Config(
        app,
        log_level="warning",
        lifespan="on",
        http="h11",
        limit_concurrency=MAX_CONNECTIONS,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpupool-console", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        asyncio.run(serve(args))
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
