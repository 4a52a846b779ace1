"""Where ``gpupool`` commands find a running stack: GPUPOOL_NATS_URL, or what ``gpupool up`` wrote.

``gpupool up`` writes ``<state dir>/up.json`` (its NATS URL, cluster file, node,
workload socket and pid) when it is up and removes it when it stops. The state
directory is ``$GPUPOOL_STATE_DIR``, else ``$XDG_STATE_HOME/gpupool``, else
``~/.local/state/gpupool``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec

NATS_URL_ENV = "GPUPOOL_NATS_URL"
STATE_DIR_ENV = "GPUPOOL_STATE_DIR"
UP_FILE = "up.json"


class RunningStack(msgspec.Struct, frozen=True, kw_only=True):
    nats_url: str
    cluster_file: str
    node: str
    socket: str
    pid: int


def default_state_dir() -> Path:
    explicit = os.environ.get(STATE_DIR_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "gpupool"


def write_running_stack(state_dir: Path, stack: RunningStack) -> Path:
    path = state_dir / UP_FILE
    temporary = path.with_suffix(".tmp")
    temporary.write_bytes(msgspec.json.encode(stack))
    temporary.replace(path)
    return path


def read_running_stack(state_dir: Path | None = None) -> RunningStack | None:
    """What ``gpupool up`` wrote, if it is still running."""
    path = (state_dir or default_state_dir()) / UP_FILE
    try:
        stack = msgspec.json.decode(path.read_bytes(), type=RunningStack)
    except (OSError, msgspec.DecodeError, json.JSONDecodeError):
        return None
    try:
        os.kill(stack.pid, 0)
    except ProcessLookupError:
        return None  # left behind by a `gpupool up` that was killed
    except PermissionError:
        pass
    return stack


def find_nats_url() -> tuple[str, str] | None:
    """(URL, where it came from): GPUPOOL_NATS_URL first, then a running ``gpupool up``."""
    url = os.environ.get(NATS_URL_ENV)
    if url:
        return url, NATS_URL_ENV
    running = read_running_stack()
    if running is not None:
        return running.nats_url, f"gpupool up (pid {running.pid})"
    return None
