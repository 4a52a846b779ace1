"""The local mode: a NATS server (unless one is given) and the four services as processes.

``LocalStack`` is what ``gpupool up`` and ``gpupool demo`` run, and what the
integration tests start: real nats-server, real service processes, each with its
own HTTP port for /healthz, /readyz and /metrics.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from gpupool.eventlog.nats_server import run_nats_server

SERVICES = ("policy", "admission-queue", "preemption", "node-executor")
MODULES = {
    "policy": "gpupool.policy",
    "admission-queue": "gpupool.admission_queue",
    "preemption": "gpupool.preemption",
    "node-executor": "gpupool.node_executor",
}
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass
class StackSettings:
    cluster_file: Path
    node: str
    state_dir: Path
    nats_url: str | None = None
    simulate_gpus: int | None = None
    message_period: float | None = None
    ports: dict[str, int] = field(default_factory=dict)
    log_level: str = "INFO"
    extra_env: dict[str, str] = field(default_factory=dict)
    identity: str = "request"
    """How the node-executor learns a caller's pod: the request (local) or the kernel."""
    run_in: str = "executor"
    """Where the node-executor runs commands: its own namespaces or the caller's."""


@dataclass
class ServiceProcess:
    name: str
    args: list[str]
    port: int
    log_path: Path
    process: asyncio.subprocess.Process | None = None
    _log_file: IO[bytes] | None = None

    async def start(self, env: dict[str, str]) -> None:
        self._log_file = self.log_path.open("ab")
        self.process = await asyncio.create_subprocess_exec(
            *self.args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
        )

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def stop(self, *, kill: bool = False) -> int | None:
        if self.process is None:
            return None
        if self.process.returncode is None:
            with suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), STOP_TIMEOUT_S)
            except TimeoutError:
                with suppress(ProcessLookupError):
                    self.process.kill()
                await self.process.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return self.process.returncode

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])


class StackFailed(RuntimeError):
    pass


class LocalStack:
    def __init__(self, settings: StackSettings, nats_url: str) -> None:
        self.settings = settings
        self.nats_url = nats_url
        self.socket_path = settings.state_dir / "gpupool.sock"
        self.logs_dir = settings.state_dir / "logs"
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self.services: dict[str, ServiceProcess] = {}
        for name in SERVICES:
            port = settings.ports.get(name) or free_port()
            self.services[name] = ServiceProcess(
                name=name,
                args=self._command(name, port),
                port=port,
                log_path=self.logs_dir / f"{name}.log",
            )

    async def start_replica(self, name: str, instance: str) -> ServiceProcess:
        """Another replica of a service (its own durable consumer, port and log)."""
        port = free_port()
        args = self._command(name, port)
        args[args.index("--instance") + 1] = instance
        replica = ServiceProcess(
            name=f"{name}-{instance}",
            args=args,
            port=port,
            log_path=self.logs_dir / f"{name}-{instance}.log",
        )
        self.services[replica.name] = replica
        await replica.start(self._env())
        await self.wait_ready([replica.name])
        return replica

    def _command(self, name: str, port: int) -> list[str]:
        s = self.settings
        args = [
            sys.executable,
            "-m",
            MODULES[name],
            "--nats",
            self.nats_url,
            "--http-port",
            str(port),
            "--instance",
            "local",
            "--log-level",
            s.log_level,
            "--snapshot-dir",
            str(s.state_dir / "snapshots"),
        ]
        if name == "policy":
            args += ["--cluster", str(s.cluster_file)]
        if name == "node-executor":
            args += [
                "--node-name",
                s.node,
                "--socket",
                str(self.socket_path),
                "--state-dir",
                str(s.state_dir / "node-executor"),
                "--identity",
                s.identity,
                "--run-in",
                s.run_in,
            ]
            if s.simulate_gpus is not None:
                args += ["--simulate-gpus", str(s.simulate_gpus)]
            if s.message_period is not None:
                args += ["--message-period", str(s.message_period)]
        return args

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.settings.extra_env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    async def start(self, names: Sequence[str] = SERVICES) -> None:
        for name in names:
            await self.services[name].start(self._env())
        await self.wait_ready(names)

    async def restart(self, name: str) -> None:
        await self.services[name].start(self._env())
        await self.wait_ready([name])

    async def stop_service(self, name: str) -> int | None:
        """SIGTERM: the service drains (and saves its snapshot)."""
        return await self.services[name].stop()

    async def kill(self, name: str) -> None:
        """kill -9: no drain, no goodbye (for crash tests)."""
        await self.services[name].stop(kill=True)

    async def stop(self) -> None:
        # the executor first: it ends workloads; then the deciders (and any extra replicas)
        for name in reversed(list(self.services)):
            await self.services[name].stop()

    async def wait_ready(self, names: Sequence[str], within: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + within
        pending = list(names)
        while pending:
            name = pending[0]
            service = self.services[name]
            if not service.running:
                raise StackFailed(
                    f"{name} exited ({service.process.returncode if service.process else '?'}) "
                    f"before it was ready; its log:\n{service.log_tail()}"
                )
            if await http_get_ok(service.port, "/readyz"):
                pending.pop(0)
                continue
            if time.monotonic() > deadline:
                raise StackFailed(
                    f"{name} not ready after {within:.0f}s; its log:\n{service.log_tail()}"
                )
            await asyncio.sleep(0.05)  # polling an HTTP probe: there is nothing to wait on


async def http_get_ok(port: int, path: str) -> bool:
    status, _ = await http_get(port, path)
    return status == 200


HTTP_TIMEOUT_S = 10.0


async def http_get(port: int, path: str) -> tuple[int, bytes]:
    """GET on 127.0.0.1; (0, b"") when nothing answers in time."""
    try:
        async with asyncio.timeout(HTTP_TIMEOUT_S):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except (OSError, TimeoutError):
        return 0, b""
    try:
        async with asyncio.timeout(HTTP_TIMEOUT_S):
            writer.write(
                f"GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n".encode()
            )
            await writer.drain()
            data = await reader.read()
    except (OSError, TimeoutError):
        return 0, b""
    finally:
        writer.close()
        with suppress(OSError):
            await writer.wait_closed()
    head, _, body = data.partition(b"\r\n\r\n")
    try:
        return int(head.split(b" ", 2)[1]), body
    except (IndexError, ValueError):
        return 0, b""


@asynccontextmanager
async def local_stack(settings: StackSettings, *, start: bool = True) -> AsyncIterator[LocalStack]:
    async with AsyncExitStack() as resources:
        url = settings.nats_url
        if url is None:
            url = await resources.enter_async_context(run_nats_server(settings.state_dir / "nats"))
        stack = LocalStack(settings, url)
        resources.push_async_callback(stack.stop)
        if start:
            await stack.start()
        yield stack
