"""Sending and receiving file descriptors (``SCM_RIGHTS``) on non-blocking sockets in asyncio.

asyncio has no ``sock_sendmsg``/``sock_recvmsg`` in Python 3.11, and a stream transport reads
with plain ``recv``, which drops ancillary data (the kernel closes fds nobody asked for). So
the request line and its fds are read with these helpers *before* the socket is handed to
asyncio streams.
"""

from __future__ import annotations

import asyncio
import os
import socket


async def _until(sock: socket.socket, *, writable: bool) -> None:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    fd = sock.fileno()
    if writable:
        loop.add_writer(fd, wake)
    else:
        loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        if writable:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)


async def send_with_fds(sock: socket.socket, data: bytes, fds: tuple[int, ...]) -> None:
    """Send all of ``data``; ``fds`` travel with its first byte."""
    while True:
        try:
            sent = socket.send_fds(sock, [data], list(fds))
            break
        except BlockingIOError:
            await _until(sock, writable=True)
    if sent < len(data):
        await asyncio.get_running_loop().sock_sendall(sock, data[sent:])


class LineTooLong(ValueError):
    pass


class TooManyFds(ValueError):
    """More file descriptors came than the receiver takes; all of them were closed."""


DEFAULT_MAX_FDS = 16


async def receive_line_with_fds(
    sock: socket.socket, max_bytes: int, *, max_fds: int = DEFAULT_MAX_FDS
) -> tuple[bytes, list[int]]:
    """Read up to and including the first newline, collecting every fd that arrives meanwhile.

    Returns ``(line, fds)``; ``line`` lacks the newline only if the peer closed first. The caller
    owns the fds, also when this raises (:class:`LineTooLong`, ``OSError``): then they are closed.
    At most ``max_fds`` fds are taken in all: the control buffer holds no more (the kernel
    closes any beyond it), and more than that over several messages raises
    :class:`TooManyFds` at once, with every received fd closed.
    """
    data = bytearray()
    fds: list[int] = []
    try:
        while b"\n" not in data:
            if len(data) > max_bytes:
                raise LineTooLong(f"no newline within {max_bytes} bytes")
            try:
                chunk, more_fds, flags, _address = socket.recv_fds(sock, 65536, max(max_fds, 1))
            except BlockingIOError:
                await _until(sock, writable=False)
                continue
            fds.extend(more_fds)
            if flags & socket.MSG_CTRUNC or len(fds) > max_fds:
                raise TooManyFds(f"more than {max_fds} file descriptors were passed")
            if not chunk:
                break
            data.extend(chunk)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    line, newline, _rest = bytes(data).partition(b"\n")
    return line + newline, fds
