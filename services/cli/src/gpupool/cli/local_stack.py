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
from collections.abc import AsyncIterator, Callable, Sequence
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
STOP_ORDER = ("admission-queue", "preemption", "node-executor", "policy")
"""The deciders first (no assignment, no preemption while stopping), then the executor (it
ends the running workloads, records their end and tells their clients), then the policy;
NATS, which all of them record through, stops after all of them."""
RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 60.0
"""A service that ran this long before it crashed is restarted at once again (backoff reset)."""


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
    nats_port: int = -1
    """The port of the NATS server the stack starts (-1: any free port)."""
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
        if self._log_file is not None:
            self._log_file.close()
        self._log_file = self.log_path.open("ab")
        self.process = await asyncio.create_subprocess_exec(
            *self.args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
            # Its own process group: a Ctrl-C at the terminal reaches only `gpupool up`,
            # which then stops the services in order (STOP_ORDER).
            start_new_session=True,
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
                async with asyncio.timeout(STOP_TIMEOUT_S):
                    await self.process.wait()
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
        self.stopping = False
        self.restarts: dict[str, int] = {}
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
                "--cluster",
                str(s.cluster_file),
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
        """Stop every service in STOP_ORDER (extra replicas with their service), each drained."""
        self.stopping = True
        for name in STOP_ORDER:
            for service_name, service in self.services.items():
                if service_name == name or service_name.startswith(name + "-"):
                    await service.stop()
        for service in self.services.values():
            await service.stop()

    async def supervise(self, report: Callable[[str], None]) -> None:
        """Restart any service that exits until :meth:`stop`: with backoff, each restart reported."""
        watchers = [
            asyncio.create_task(self._watch(name, report), name=f"watch-{name}")
            for name in SERVICES
        ]
        try:
            await asyncio.gather(*watchers)
        finally:
            for watcher in watchers:
                watcher.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)

    async def _watch(self, name: str, report: Callable[[str], None]) -> None:
        service = self.services[name]
        crashes = 0
        while not self.stopping:
            process = service.process
            assert process is not None
            started = time.monotonic()
            code = await process.wait()
            if self.stopping:
                return
            crashes = 1 if time.monotonic() - started >= STABLE_AFTER_S else crashes + 1
            delay = min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2 ** (crashes - 1))
            self.restarts[name] = self.restarts.get(name, 0) + 1
            report(
                f"{name} exited with status {code}; restarting it in {delay:g}s "
                f"(restart {self.restarts[name]}; log: {service.log_path})"
            )
            await asyncio.sleep(delay)  # the backoff itself
            if self.stopping:
                return
            await service.start(self._env())
            try:
                await self.wait_ready([name])
            except StackFailed as failure:
                report(f"{name} did not come back: {str(failure).splitlines()[0]}")
                continue
            report(f"{name} is back (pid {service.process.pid if service.process else '?'})")

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
            url = await resources.enter_async_context(
                run_nats_server(settings.state_dir / "nats", port=settings.nats_port)
            )
        stack = LocalStack(settings, url)
        resources.push_async_callback(stack.stop)
        if start:
            await stack.start()
        yield stack
