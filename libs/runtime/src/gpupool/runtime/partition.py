"""One node's share of a whole-log projection: what a partitioned reader folds (its node only).

The node-executor folds its own node's entries only (docs/eventlog.md, "A node's
partition"), so its snapshot holds one node. The archive's checkpoints (and a snapshot
taken before the partition) are folds of the whole log. The state is partitioned by node
(every pod, queue, usage and per-node sequence belongs to one node), so the node's part
of a whole fold is what the partitioned reader would have folded from the same entries:
:func:`restrict_to_node` keeps exactly that, and a partitioned service starts from a
whole-cluster checkpoint instead of rebuilding (which a purge makes impossible).

Kept whole, because they are not per node: the watermark (``last_seq``, ``ahead``,
``open_entry``), the count of undecodable entries, the envelope ids applied (a replay is
still recognised), and the rejections folded (``rejected_sequences``: an entry set aside
once is never set aside again; ``rejected_messages``). The node-less entries'
sequences (``NODELESS``) are kept too: they are the expectation of a rejection it appends.
"""

from __future__ import annotations

import copy

from gpupool.core import State
from gpupool.core.admission_check import EnvelopeIds
from gpupool.events import NODELESS
from gpupool.runtime.projection import Projection
from gpupool.runtime.statistics import LogStatistics


def restrict_state_to_node(state: State, node: str) -> State:
    """A copy of ``state`` holding ``node`` (and the node-less part) only."""
    kept = {name for name in (node, NODELESS) if name in state.nodes}
    nodes = {name: copy.deepcopy(state.nodes[name]) for name in kept}
    listed = {ref for name in kept for ref in state.nodes[name].pods}
    pods = {
        ref: copy.deepcopy(pod)
        for ref, pod in state.pods.items()
        if pod.node in (node, NODELESS) or ref in listed
    }
    return State(
        nodes=nodes,
        pods=pods,
        rejected_messages=state.rejected_messages,
        rejected_sequences=set(state.rejected_sequences),
    )


def restrict_to_node(projection: Projection, node: str) -> Projection:
    """``projection`` (a fold of the whole log) as a reader of ``node``'s partition has it.

    Observers are not copied (they are code: attach them afterwards, as after a load).
    """
    statistics = None
    if projection.statistics is not None:
        statistics = LogStatistics(
            nodes={
                name: stats
                for name, stats in projection.statistics.copy().nodes.items()
                if name in (node, NODELESS)
            }
        )
    return Projection(
        state=restrict_state_to_node(projection.state, node),
        last_seq=projection.last_seq,
        node_seq={n: s for n, s in projection.node_seq.items() if n in (node, NODELESS)},
        undecodable=projection.undecodable,
        ahead=set(projection.ahead),
        ahead_nodes={s: n for s, n in projection.ahead_nodes.items() if n in (node, NODELESS)},
        statistics=statistics,
        open_entry=projection.open_entry,
        envelope_ids=EnvelopeIds(
            projection.envelope_ids.to_list(), limit=projection.envelope_ids.limit
        ),
        writer_seq={
            (n, writer): s
            for (n, writer), s in projection.writer_seq.items()
            if n in (node, NODELESS)
        },
    )
