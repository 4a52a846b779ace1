"""Where projection snapshots are kept: a two-method port and a file adapter.

A service saves a snapshot now and then and, on start, resumes from the newest one,
consuming the log from ``last_seq + 1``. A missing, damaged or unknown-format
snapshot is not an error: the projection is rebuilt from zero, which gives the same
result, only slower. (A JetStream key-value adapter would implement the same port
in a package that depends on nats-py.)
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from gpupool.runtime.projection import Projection, metrics_projection
from gpupool.runtime.snapshot import SnapshotFormatError, decode_snapshot, encode_snapshot


class SnapshotStore(Protocol):
    """Keeps the latest snapshot of one projection, as opaque bytes."""

    async def save(self, data: bytes) -> None:
        """Replace the stored snapshot; after this returns, a crash leaves the old or the new one."""
        ...

    async def load(self) -> bytes | None:
        """The stored snapshot, or None if there is none."""
        ...


class FileSnapshotStore:
    """One file; written atomically (a temporary file in the same directory, fsync, rename)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    async def save(self, data: bytes) -> None:
        await asyncio.to_thread(self.write, data)

    async def load(self) -> bytes | None:
        return await asyncio.to_thread(self.read)

    def write(self, data: bytes) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)

    def read(self) -> bytes | None:
        try:
            return self.path.read_bytes()
        except FileNotFoundError:
            return None


async def save_projection(store: SnapshotStore, projection: Projection) -> int:
    """Store a snapshot of ``projection``; returns the sequence it covers."""
    snapshot = projection.to_snapshot()
    await store.save(encode_snapshot(snapshot))
    return snapshot.last_seq


async def load_projection(
    store: SnapshotStore, *, empty: Callable[[], Projection] = metrics_projection
) -> tuple[Projection, str]:
    """The projection to resume from and why: from the stored snapshot, else ``empty()``.

    The snapshot is set aside (rebuild from zero) when it is missing, cannot be
    read, or lacks statistics that ``empty()`` keeps. The second item says which,
    for the service's log line.
    """
    data = await store.load()
    if data is None:
        return empty(), "no snapshot: rebuilding from the start of the log"
    try:
        snapshot = decode_snapshot(data)
    except SnapshotFormatError as error:
        return empty(), f"snapshot set aside ({error}): rebuilding from the start of the log"
    fresh = empty()
    if fresh.statistics is not None and snapshot.statistics is None:
        return fresh, "snapshot has no statistics: rebuilding from the start of the log"
    projection = Projection.from_snapshot(snapshot)
    if fresh.statistics is None:
        projection.statistics = None
    projection.observers = fresh.observers
    return projection, f"resuming after sequence {snapshot.last_seq} from the snapshot"
