"""The audit read models: pure folds of the event log into the views gpupool offers.

Each folds the log with the services' own projection (the core ``evolve``), so an
audit sees exactly the state the services saw. No I/O and no printing: the CLI
(``gpupool log|history|state|explain``) and the web console render them.

* :mod:`~gpupool.audit.log` — entries filtered by pod, node, type and time.
* :mod:`~gpupool.audit.history` — one pod's steps: ready, positions, GPU, preemptions, ends.
* :mod:`~gpupool.audit.state` — each node at a moment: GPUs, holders, the ready queue with
  positions, waits and estimates.
* :mod:`~gpupool.audit.occupancy` — who held which GPU when: one interval per assignment.
* :mod:`~gpupool.audit.preemptions` — every preemption with both sides.
* :mod:`~gpupool.audit.estimate` — the wait estimate from recent completed holds.
* :mod:`~gpupool.audit.explain` — why a pod waits, from the core's structured diagnosis.
"""

from gpupool.audit.errors import DEFAULT_NAMESPACE, AuditError, parse_pod
from gpupool.audit.estimate import RECENT_HOLDS, WaitEstimate, estimate_wait
from gpupool.audit.explain import Explanation, Reason, explain, reasons
from gpupool.audit.fold import Folded, Hold, fold_until
from gpupool.audit.history import History, PodStep, QueueCause, pod_history
from gpupool.audit.log import (
    UNDECODABLE_TYPE,
    LogFilter,
    entry_matches,
    involves,
    log_origin,
    select_entries,
    stored_events,
)
from gpupool.audit.occupancy import GpuInterval, gpu_intervals
from gpupool.audit.preemptions import PreemptionRecord, preemptions
from gpupool.audit.state import (
    GpuView,
    NodeView,
    PodSlot,
    QueuedPod,
    StateView,
    node_view,
    state_at,
)

__all__ = [
    "DEFAULT_NAMESPACE",
    "RECENT_HOLDS",
    "UNDECODABLE_TYPE",
    "AuditError",
    "Explanation",
    "Folded",
    "GpuInterval",
    "GpuView",
    "History",
    "Hold",
    "LogFilter",
    "NodeView",
    "PodSlot",
    "PodStep",
    "PreemptionRecord",
    "QueueCause",
    "QueuedPod",
    "Reason",
    "StateView",
    "WaitEstimate",
    "entry_matches",
    "estimate_wait",
    "explain",
    "fold_until",
    "gpu_intervals",
    "involves",
    "log_origin",
    "node_view",
    "parse_pod",
    "pod_history",
    "preemptions",
    "reasons",
    "select_entries",
    "state_at",
    "stored_events",
]
