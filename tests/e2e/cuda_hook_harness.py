"""Real workload processes under the CUDA hook, against the fake CUDA driver.

The hook and the fake driver are built by scripts/build-cuda-hook.sh (the project's setup; run
again here, it rebuilds only what changed). Each process is either the C program or the Python
ctypes program of tests/fake_cuda, reaching the driver through dlopen + dlsym or through
cuGetProcAddress_v2; it runs the steps it is given and prints one line per step.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Literal

ROOT = Path(__file__).resolve().parents[2]
HOOK = ROOT / "libs" / "cuda_hook" / "build" / "libgpupool-cuda-hook.so"
FAKE_DRIVER_DIR = ROOT / "tests" / "fake_cuda" / "build"
C_PROGRAM = FAKE_DRIVER_DIR / "cuda_program"
PY_PROGRAM = ROOT / "tests" / "fake_cuda" / "cuda_program.py"
WAITING = re.compile(r"^You have been waiting for (\d+) seconds\. Approximate position: (\d+)$")

Program = Literal["c", "python"]
Route = Literal["dlsym", "procaddress"]


@cache
def build() -> None:
    subprocess.run(["bash", str(ROOT / "scripts" / "build-cuda-hook.sh")], check=True)


@dataclass
class HookedProcess:
    name: str
    process: asyncio.subprocess.Process
    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    readers: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.process.pid

    async def _read(self, stream: asyncio.StreamReader, into: list[str]) -> None:
        async for raw in stream:
            into.append(raw.decode(errors="replace").rstrip("\n"))
            self.changed.set()
        self.changed.set()

    async def until(
        self, predicate: Callable[[], bool], what: str, *, within: float = 30.0
    ) -> None:
        async with asyncio.timeout(within):
            while not predicate():
                if self.process.returncode is not None and all(r.done() for r in self.readers):
                    raise AssertionError(
                        f"{self.name} exited before {what}: {self.stdout} {self.stderr}"
                    )
                self.changed.clear()
                await self.changed.wait()

    async def until_stdout(self, line: str, *, within: float = 30.0) -> None:
        await self.until(lambda: line in self.stdout, repr(line), within=within)

    def waiting(self) -> list[tuple[int, int]]:
        return [
            (int(m.group(1)), int(m.group(2)))
            for line in self.stderr
            if (m := WAITING.match(line)) is not None
        ]

    async def go_on(self) -> None:
        """Answer its `wait` step."""
        assert self.process.stdin is not None
        with suppress(ConnectionError):
            self.process.stdin.write(b"go\n")
            await self.process.stdin.drain()

    async def exit_code(self, within: float = 30.0) -> int:
        async with asyncio.timeout(within):
            code = await self.process.wait()
            await asyncio.gather(*self.readers)
        return code


def hook_environment(
    socket: Path, namespace: str | None, pod: str | None, driver_log: Path
) -> dict[str, str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("GPUPOOL_", "CUDA_", "FAKE_CUDA_"))
    }
    env |= {
        "LD_PRELOAD": str(HOOK),
        "LD_LIBRARY_PATH": str(FAKE_DRIVER_DIR),
        "GPUPOOL_SOCKET": str(socket),
        "FAKE_CUDA_LOG": str(driver_log),
    }
    if namespace is not None and pod is not None:
        env |= {"GPUPOOL_POD_NAMESPACE": namespace, "GPUPOOL_POD_NAME": pod}
    return env


async def start_hooked(
    socket: Path,
    pod: str | None,
    steps: list[str],
    *,
    driver_log: Path,
    program: Program = "c",
    route: Route = "dlsym",
    namespace: str = "default",
    name: str | None = None,
    env: dict[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> HookedProcess:
    build()
    argv = (
        [str(C_PROGRAM), route, *steps]
        if program == "c"
        else [sys.executable, str(PY_PROGRAM), route, *steps]
    )
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=(env or {}) | hook_environment(socket, namespace if pod else None, pod, driver_log),
        preexec_fn=preexec_fn,
    )
    hooked = HookedProcess(name=name or pod or "?", process=process)
    assert process.stdout is not None and process.stderr is not None
    hooked.readers = [
        asyncio.create_task(hooked._read(process.stdout, hooked.stdout)),
        asyncio.create_task(hooked._read(process.stderr, hooked.stderr)),
    ]
    return hooked


def driver_calls(driver_log: Path, pid: int) -> list[str]:
    """The fake driver's record of ``pid``'s calls, each without its pid."""
    if not driver_log.exists():
        return []
    prefix = f"pid={pid} "
    return [
        line.removeprefix(prefix)
        for line in driver_log.read_text().splitlines()
        if line.startswith(prefix)
    ]


def visible_devices_at_init(driver_log: Path, pid: int) -> list[str]:
    return [
        call.split("CUDA_VISIBLE_DEVICES=", 1)[1]
        for call in driver_calls(driver_log, pid)
        if call.startswith("cuInit ")
    ]
