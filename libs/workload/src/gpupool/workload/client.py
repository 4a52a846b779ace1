"""The client side: connect, hand over the request and our stdio, relay what the executor says.

``gpupool run --pod NAME [--namespace NS] [--requeue] [--socket PATH] -- CMD...`` is
:func:`run_main`; the CLI only has to call it.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO

import msgspec

from gpupool.events import PodRef
from gpupool.workload.fd_passing import send_with_fds
from gpupool.workload.messages import (
    EXIT_EXECUTOR_UNAVAILABLE,
    EXIT_REJECTED,
    ConsoleReporter,
    exit_code_for,
)
from gpupool.workload.protocol import (
    ExecutorMessage,
    Exited,
    ProtocolError,
    Rejected,
    RunRequest,
    decode_executor_message,
    encode_line,
)

DEFAULT_SOCKET_PATH = "/run/gpupool/gpupool.sock"
SOCKET_PATH_VARIABLE = "GPUPOOL_SOCKET"
"""Overrides the default socket path; ``--socket`` overrides both."""

StdioFds = tuple[int, int, int]


class ExecutorUnavailable(ConnectionError):
    """There is no executor at the socket, or it went away before its last word."""

    def __init__(self, message: str, *, after_connect: bool = False) -> None:
        super().__init__(message)
        self.after_connect = after_connect


async def run_workload(
    socket_path: str | os.PathLike[str],
    request: RunRequest,
    *,
    on_message: Callable[[ExecutorMessage], None],
    fds: StdioFds = (0, 1, 2),
    reconnect_seconds: float = 0.0,
    on_retry: Callable[[str], None] | None = None,
) -> int:
    """Ask the executor at ``socket_path`` to run ``request`` with our ``fds`` as its stdio.

    Calls ``on_message`` for every message, then returns the exit code for ``gpupool run``
    (see :mod:`gpupool.workload.messages`). If the executor goes away before its last word
    (it crashed or is being restarted), reconnect for up to ``reconnect_seconds`` and
    *reattach* to the run in progress (the executor never starts it twice); the first
    connection is retried for as long too while nothing listens at the socket. Raises
    :class:`ExecutorUnavailable` when the executor cannot be reached (again), and
    :class:`ProtocolError` when it talks nonsense. Cancelling this coroutine closes the
    connection, which the executor takes as "cancel".
    """
    loop = asyncio.get_running_loop()
    if not request.sent_at:
        request = msgspec.structs.replace(request, sent_at=time.time())
    deadline = loop.time() + reconnect_seconds
    told_retrying = False
    while True:  # the first connection: retried while no executor listens (it may be restarting)
        try:
            return await _one_connection(socket_path, request, on_message, fds)
        except ExecutorUnavailable as error:
            lost = error
            if lost.after_connect:
                break
            if loop.time() >= deadline:
                if reconnect_seconds <= 0:
                    raise
                raise ExecutorUnavailable(
                    f"{lost} (gave up connecting after {reconnect_seconds:g}s)"
                ) from lost
            if on_retry is not None and not told_retrying:
                on_retry(f"{lost}; trying again for up to {reconnect_seconds:g}s")
                told_retrying = True
            await asyncio.sleep(RECONNECT_INTERVAL_SECONDS)  # back off before the next attempt
    if reconnect_seconds <= 0:
        raise lost
    deadline = loop.time() + reconnect_seconds
    last = lost
    reattach = msgspec.structs.replace(request, reattach=True)
    while loop.time() < deadline:
        try:
            return await _one_connection(socket_path, reattach, on_message, fds)
        except ExecutorUnavailable as error:
            last = error
            if error.after_connect:  # reattached, then lost again: a new window from now
                deadline = loop.time() + reconnect_seconds
            await asyncio.sleep(RECONNECT_INTERVAL_SECONDS)  # back off before the next attempt
    raise ExecutorUnavailable(f"{last} (gave up reconnecting after {reconnect_seconds:.0f}s)")


RECONNECT_INTERVAL_SECONDS = 0.2
DEFAULT_RECONNECT_SECONDS = 60.0
"""How long ``gpupool run`` keeps trying to reattach after losing the node-executor."""


async def _one_connection(
    socket_path: str | os.PathLike[str],
    request: RunRequest,
    on_message: Callable[[ExecutorMessage], None],
    fds: StdioFds,
) -> int:
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, os.fspath(socket_path))
        await send_with_fds(sock, encode_line(request), fds)
    except OSError as error:
        sock.close()
        raise ExecutorUnavailable(
            f"cannot reach the node-executor at {socket_path}: {error}"
        ) from error
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    try:
        while True:
            try:
                line = await reader.readline()
            except (ConnectionError, ValueError) as error:
                raise ExecutorUnavailable(
                    f"lost the node-executor: {error}", after_connect=True
                ) from error
            if not line.endswith(b"\n"):
                raise ExecutorUnavailable(
                    "the node-executor hung up before the command ended", after_connect=True
                )
            message = decode_executor_message(line)
            on_message(message)
            if isinstance(message, Exited | Rejected):
                return exit_code_for(message)
    finally:
        writer.close()


class RunInvocation(msgspec.Struct, frozen=True, kw_only=True):
    """``gpupool run``'s command line, parsed."""

    pod: PodRef
    argv: list[str]
    requeue: bool
    socket_path: str
    reconnect_seconds: float = 60.0


class UsageError(ValueError):
    pass


RUN_USAGE = (
    "usage: gpupool run --pod NAME [--namespace NS] [--requeue] [--socket PATH]"
    " [--reconnect-seconds S] -- CMD [ARG...]"
)


def parse_run_arguments(args: Sequence[str], environ: Mapping[str, str]) -> RunInvocation:
    """Options, then ``--``, then the command. ``--pod`` and ``--namespace`` fall back to the
    Downward API variables ``POD_NAME`` and ``POD_NAMESPACE`` (then ``default``)."""
    values: dict[str, str] = {}
    requeue = False
    rest = list(args)
    while rest:
        word = rest.pop(0)
        if word == "--":
            break
        if word == "--requeue":
            requeue = True
            continue
        name, equals, value = word.partition("=")
        if name not in ("--pod", "--namespace", "--socket", "--reconnect-seconds"):
            if not word.startswith("-"):
                rest.insert(0, word)
                break
            raise UsageError(f"unknown option {word!r}")
        if not equals:
            if not rest:
                raise UsageError(f"{name} needs a value")
            value = rest.pop(0)
        values[name] = value
    pod_name = values.get("--pod") or environ.get("POD_NAME", "")
    if not pod_name:
        raise UsageError("--pod NAME is required")
    if not rest:
        raise UsageError("no command given after --")
    try:
        reconnect = float(values.get("--reconnect-seconds", DEFAULT_RECONNECT_SECONDS))
    except ValueError as error:
        raise UsageError("--reconnect-seconds needs a number of seconds") from error
    return RunInvocation(
        reconnect_seconds=reconnect,
        pod=PodRef(
            namespace=values.get("--namespace") or environ.get("POD_NAMESPACE") or "default",
            name=pod_name,
        ),
        argv=rest,
        requeue=requeue,
        socket_path=values.get("--socket")
        or environ.get(SOCKET_PATH_VARIABLE)
        or DEFAULT_SOCKET_PATH,
    )


def run_main(
    args: Sequence[str],
    *,
    environ: Mapping[str, str] | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
    fds: StdioFds = (0, 1, 2),
) -> int:
    """``gpupool run``: returns the exit code (the command's own, or one of messages.EXIT_*)."""
    environ = os.environ if environ is None else environ
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    try:
        invocation = parse_run_arguments(args, environ)
    except UsageError as error:
        err.write(f"gpupool run: {error}\n{RUN_USAGE}\n")
        return EXIT_REJECTED
    request = RunRequest(
        pod=invocation.pod,
        argv=invocation.argv,
        cwd=os.getcwd(),
        env=dict(environ),
        requeue=invocation.requeue,
    )
    try:
        return asyncio.run(
            run_workload(
                invocation.socket_path,
                request,
                on_message=ConsoleReporter(out, err),
                fds=fds,
                reconnect_seconds=invocation.reconnect_seconds,
                on_retry=lambda text: print(f"gpupool run: {text}", file=err, flush=True),
            )
        )
    except (ExecutorUnavailable, ProtocolError) as error:
        err.write(f"gpupool run: {error}\n")
        return EXIT_EXECUTOR_UNAVAILABLE
