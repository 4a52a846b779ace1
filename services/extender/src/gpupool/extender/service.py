"""The extender's HTTP handlers: decode ExtenderArgs, apply the rules on the cache, answer."""

from __future__ import annotations

import logging
from collections import Counter

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpupool.extender.cluster_cache import ClusterCache
from gpupool.extender.protocol import (
    ExtenderArgs,
    ExtenderFilterResult,
    NodeItems,
    decode_args,
    encode,
)
from gpupool.extender.rules import ShareUsage, filter_nodes, prioritize
from gpupool.kube.records import Node, Pod
from gpupool.runtime.http import HttpEndpoint, Response

log = logging.getLogger(__name__)

JSON = "application/json"
_POD = msgspec.json.Decoder(Pod)
_NODE = msgspec.json.Decoder(Node)


MAX_EXTENDER_BODY = 64 * 1024 * 1024
"""ExtenderArgs carry the candidate nodes whole (nodeCacheCapable: false)."""


class ExtenderHandlers:
    def __init__(self, cache: ClusterCache) -> None:
        self._cache = cache
        self.answered: Counter[tuple[str, str]] = Counter()
        """Requests answered, by (verb, outcome): outcome ``ok`` or ``bad-request``."""

    def install(self, endpoint: HttpEndpoint) -> None:
        # The scheduler sends every candidate node in full: room for a few thousand nodes.
        endpoint.add("POST", "/filter", self.filter, max_body=MAX_EXTENDER_BODY)
        endpoint.add("POST", "/prioritize", self.prioritize, max_body=MAX_EXTENDER_BODY)

    def _read(self, body: bytes) -> tuple[ExtenderArgs, Pod, list[Node]]:
        args = decode_args(body)
        pod = _POD.decode(args.pod)
        if args.nodes is not None:
            nodes = [_NODE.decode(raw) for raw in args.nodes.items]
        elif args.node_names is not None:
            nodes = [self._cache.node(name) for name in args.node_names]
        else:
            raise msgspec.ValidationError("ExtenderArgs has neither nodes nor nodenames")
        return args, pod, nodes

    async def filter(self, body: bytes) -> Response:
        try:
            args, pod, nodes = self._read(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.answered["filter", "bad-request"] += 1
            return 400, JSON, encode(ExtenderFilterResult(error=f"cannot read ExtenderArgs: {exc}"))
        outcome = filter_nodes(pod, nodes, self._usage(pod))
        log.debug(
            "filter %s: %d passed, %d failed", pod.ref, len(outcome.passed), len(outcome.failed)
        )
        if args.nodes is not None:
            keep = set(outcome.passed)
            items = [
                raw for raw, node in zip(args.nodes.items, nodes, strict=True) if node.name in keep
            ]
            result = ExtenderFilterResult(nodes=NodeItems(items=items), failed_nodes=outcome.failed)
        else:
            result = ExtenderFilterResult(node_names=outcome.passed, failed_nodes=outcome.failed)
        self.answered["filter", "ok"] += 1
        return 200, JSON, encode(result)

    async def prioritize(self, body: bytes) -> Response:
        try:
            _, pod, nodes = self._read(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.answered["prioritize", "bad-request"] += 1
            return 400, "text/plain", f"cannot read ExtenderArgs: {exc}\n".encode()
        self.answered["prioritize", "ok"] += 1
        cache = self._cache
        scores = prioritize(
            pod, nodes, self._usage(pod), cache.model, cache.workload(), cost=cache.cost
        )
        return 200, JSON, encode(scores)

    def _usage(self, pod: Pod) -> ShareUsage:
        cache = self._cache
        return lambda node: cache.share_usage(node, excluding=pod.ref)


class ExtenderCollector:
    """Prometheus figures of the extender, computed on scrape from the cache and the handlers."""

    def __init__(self, cache: ClusterCache, handlers: ExtenderHandlers) -> None:
        self._cache = cache
        self._handlers = handlers

    def collect(self) -> list[Metric]:
        ready = GaugeMetricFamily("gpupool_extender_ready", "1 once nodes and pods are listed")
        ready.add_metric([], 1.0 if self._cache.ready else 0.0)
        nodes = GaugeMetricFamily("gpupool_extender_cached_nodes", "nodes in the extender's cache")
        nodes.add_metric([], float(len(self._cache.nodes)))
        pods = GaugeMetricFamily("gpupool_extender_cached_pods", "pods in the extender's cache")
        pods.add_metric([], float(len(self._cache.pods)))
        answered = CounterMetricFamily(
            "gpupool_extender_requests",
            "scheduler requests answered, by verb and outcome",
            labels=["verb", "outcome"],
        )
        for (verb, outcome), count in sorted(self._handlers.answered.items()):
            answered.add_metric([verb, outcome], float(count))
        return [ready, nodes, pods, answered]
