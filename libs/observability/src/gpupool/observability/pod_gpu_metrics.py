"""``gpupool_pod_gpu_info``: which pod holds which GPU now, one series per holding.

The value is always 1; the labels carry the facts (node, namespace, pod, GPU index,
GPU UUID). A series exists only while the pod holds the GPU: a share-pool pod from
its ``Assigned`` to its release, a static pod while it is bound. So the number of
series is the number of current holdings, at most the running pods of each node
(bounded by the GPUs × 100 % / the smallest limit), and a pod that is assigned again
starts a new series rather than growing one. Grafana draws "who held which GPU
when" from it (a state timeline, one row per pod and GPU); docs/metrics.md.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import GaugeMetricFamily, Metric

from gpupool.core import PodState
from gpupool.runtime.projection import Projection

POD_GPU_INFO = "gpupool_pod_gpu_info"
POD_GPU_LABELS = ("node", "namespace", "pod", "gpu", "uuid")


def holds_gpu(pod: PodState) -> bool:
    if pod.gpu_index is None:
        return False
    return pod.policy == "static" or pod.phase == "running"


class PodGpuCollector:
    def __init__(self, projection: Projection) -> None:
        self.projection = projection

    def describe(self) -> Iterable[Metric]:
        return [self._family()]

    def collect(self) -> Iterable[Metric]:
        family = self._family()
        state = self.projection.state
        for pod in sorted(
            state.pods.values(),
            key=lambda p: (p.node, p.gpu_index or 0, p.ref.namespace, p.ref.name),
        ):
            if holds_gpu(pod):
                node = state.nodes.get(pod.node)
                uuid = pod.gpu_uuid
                if not uuid and node is not None:
                    uuid = next((g.uuid for g in node.gpus if g.index == pod.gpu_index), "")
                family.add_metric(
                    [pod.node, pod.ref.namespace, pod.ref.name, str(pod.gpu_index), uuid], 1
                )
        return [family]

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            POD_GPU_INFO,
            "1 for each pod holding a GPU now (labels: node, namespace, pod, gpu index, uuid); "
            "no series when it holds none.",
            labels=POD_GPU_LABELS,
        )
