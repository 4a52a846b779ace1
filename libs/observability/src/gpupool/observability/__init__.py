"""Projections of the log: the state services read, metrics computed on scrape, snapshots."""

from gpupool.observability.executor_metrics import (
    ExecutorCollector,
    ExecutorReadings,
    GpuReading,
    ProcessUtilisation,
)
from gpupool.observability.metrics import (
    POOLING_POSITION,
    POOLING_STATUS,
    PoolingCollector,
    QueueCollector,
    metrics_registry,
)
from gpupool.observability.projection import Projection, metrics_projection
from gpupool.observability.snapshot import (
    SNAPSHOT_FORMAT,
    Snapshot,
    SnapshotFormatError,
    decode_snapshot,
    encode_snapshot,
)
from gpupool.observability.snapshot_store import (
    FileSnapshotStore,
    SnapshotStore,
    load_projection,
    save_projection,
)
from gpupool.observability.statistics import (
    WAIT_BUCKETS_SECONDS,
    LogStatistics,
    NodeStatistics,
    WaitHistogram,
)

__all__ = [
    "POOLING_POSITION",
    "POOLING_STATUS",
    "SNAPSHOT_FORMAT",
    "WAIT_BUCKETS_SECONDS",
    "ExecutorCollector",
    "ExecutorReadings",
    "FileSnapshotStore",
    "GpuReading",
    "LogStatistics",
    "NodeStatistics",
    "PoolingCollector",
    "ProcessUtilisation",
    "Projection",
    "QueueCollector",
    "Snapshot",
    "SnapshotFormatError",
    "SnapshotStore",
    "WaitHistogram",
    "decode_snapshot",
    "encode_snapshot",
    "load_projection",
    "metrics_projection",
    "metrics_registry",
    "save_projection",
]
