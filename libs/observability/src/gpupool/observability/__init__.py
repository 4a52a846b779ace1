"""What gpupool shows: the DCGM_FI_POOLING_* and queue metrics, computed on scrape, and the
node-executor's GPU readings.

It *reads* the write model (``gpupool.runtime.projection``: the state the deciders
commit against, its snapshots and the counters folded with it); it never owns it.
``Projection`` and friends are re-exported here for readers.
"""

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
from gpupool.runtime.projection import Projection, metrics_projection
from gpupool.runtime.snapshot import (
    SNAPSHOT_FORMAT,
    Snapshot,
    SnapshotFormatError,
    decode_snapshot,
    encode_snapshot,
)
from gpupool.runtime.snapshot_store import (
    FileSnapshotStore,
    SnapshotStore,
    load_projection,
    save_projection,
)
from gpupool.runtime.statistics import (
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
