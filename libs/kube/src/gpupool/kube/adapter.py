"""``KubernetesApi`` over kubernetes-asyncio.

kubernetes-asyncio supplies the configuration (in-cluster service account,
kubeconfig, or a plain host URL) and the authenticated aiohttp transport; the
requests are made with ``ApiClient.call_api`` and ``_preload_content=False`` so
that responses are decoded straight into gpupool's msgspec records (no
generated models) and query parameters are spelled as the API server documents
them (``watch=true``; the generated methods would send ``True``).

Writes:

* node status: ``PATCH /api/v1/nodes/{name}/status``, strategic merge (our two
  conditions merge by ``type``; a null resource is removed);
* node annotation: ``PATCH /api/v1/nodes/{name}``, JSON merge patch;
* events: ``POST /api/v1/namespaces/{ns}/events`` (409 AlreadyExists is success);
* pod condition: ``PATCH /api/v1/namespaces/{ns}/pods/{name}/status``, strategic merge.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any
from urllib.parse import quote

import aiohttp
import msgspec
from kubernetes_asyncio import config
from kubernetes_asyncio.client import ApiClient, Configuration

from gpupool.kube.listwatch import ListWatcher, Params, Status, WatchSettings
from gpupool.kube.port import KubernetesApiError
from gpupool.kube.records import (
    Node,
    NodeChange,
    NodeStatusPatch,
    Pod,
    PodChange,
    PodCondition,
    PodEvent,
    Synced,
)

STRATEGIC_MERGE = "application/strategic-merge-patch+json"
MERGE_PATCH = "application/merge-patch+json"
_STATUS = msgspec.json.Decoder(Status)


class KubernetesAsyncioApi:
    def __init__(self, client: ApiClient, *, watch_settings: WatchSettings | None = None) -> None:
        self._client = client
        self._watch_settings = watch_settings or WatchSettings()

    @classmethod
    async def connect(
        cls,
        *,
        host: str | None = None,
        kubeconfig: str | None = None,
        context: str | None = None,
        watch_settings: WatchSettings | None = None,
    ) -> KubernetesAsyncioApi:
        """A plain ``host`` URL (no credentials: kubectl proxy, tests); else ``kubeconfig``;
        else the in-cluster service account; else ``~/.kube/config``."""
        configuration: Any = type.__call__(Configuration)
        if host:
            configuration.host = host.rstrip("/")
        elif kubeconfig:
            await config.load_kube_config(
                config_file=kubeconfig, context=context, client_configuration=configuration
            )
        elif os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        else:
            await config.load_kube_config(context=context, client_configuration=configuration)
        return cls(ApiClient(configuration), watch_settings=watch_settings)

    async def close(self) -> None:
        await self._client.close()

    async def __aenter__(self) -> KubernetesAsyncioApi:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # ----------------------------------------------------------------------- transport

    async def _request(
        self,
        method: str,
        path: str,
        *,
        params: Params = (),
        body: Any = None,
        content_type: str = "application/json",
        client_timeout: aiohttp.ClientTimeout | None = None,
    ) -> aiohttp.ClientResponse:
        response: aiohttp.ClientResponse = await self._client.call_api(
            path,
            method,
            query_params=list(params),
            header_params={"Accept": "application/json", "Content-Type": content_type},
            body=body,
            auth_settings=["BearerToken"],
            _preload_content=False,
            _request_timeout=client_timeout,
        )
        if response.status >= 300:
            payload = await response.read()
            response.release()
            try:
                status = _STATUS.decode(payload)
                reason, message = status.reason, status.message
            except msgspec.DecodeError:
                reason, message = response.reason or "", payload[:200].decode(errors="replace")
            raise KubernetesApiError(response.status, reason, message)
        return response

    async def get(self, path: str, params: Params) -> bytes:
        response = await self._request("GET", path, params=params)
        try:
            return await response.read()
        finally:
            response.release()

    @asynccontextmanager
    async def stream(self, path: str, params: Params) -> AsyncIterator[AsyncIterator[bytes]]:
        read_limit = self._watch_settings.timeout_seconds + 30
        timeout = aiohttp.ClientTimeout(sock_connect=30, sock_read=read_limit)
        response = await self._request("GET", path, params=params, client_timeout=timeout)
        try:
            yield _lines(response)
        finally:
            response.close()

    async def _write(self, method: str, path: str, body: Any, content_type: str) -> None:
        response = await self._request(method, path, body=body, content_type=content_type)
        response.release()

    # ----------------------------------------------------------------------- the port

    def watch_nodes(self) -> AsyncIterator[NodeChange | Synced]:
        return ListWatcher(self, "/api/v1/nodes", Node, settings=self._watch_settings).changes()

    def watch_pods(self) -> AsyncIterator[PodChange | Synced]:
        return ListWatcher(self, "/api/v1/pods", Pod, settings=self._watch_settings).changes()

    async def patch_node_status(self, name: str, patch: NodeStatusPatch) -> None:
        status: dict[str, Any] = {}
        if patch.capacity:
            status["capacity"] = patch.capacity
        if patch.allocatable:
            status["allocatable"] = patch.allocatable
        if patch.conditions:
            status["conditions"] = msgspec.to_builtins(patch.conditions)
        await self._write(
            "PATCH", f"/api/v1/nodes/{_segment(name)}/status", {"status": status}, STRATEGIC_MERGE
        )

    async def patch_node_annotations(self, name: str, annotations: dict[str, str | None]) -> None:
        body = {"metadata": {"annotations": annotations}}
        await self._write("PATCH", f"/api/v1/nodes/{_segment(name)}", body, MERGE_PATCH)

    async def create_event(self, event: PodEvent) -> None:
        namespace = event.pod.namespace
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": event.name, "namespace": namespace},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "namespace": namespace,
                "name": event.pod.name,
                **({"uid": event.pod_uid} if event.pod_uid else {}),
            },
            "type": event.type,
            "reason": event.reason,
            "message": event.message,
            "source": {"component": event.source_component},
            "reportingComponent": event.reporting_component,
            "firstTimestamp": event.time,
            "lastTimestamp": event.time,
            "count": 1,
        }
        try:
            await self._write(
                "POST", f"/api/v1/namespaces/{_segment(namespace)}/events", body, "application/json"
            )
        except KubernetesApiError as exc:
            if exc.status != 409:
                raise

    async def patch_pod_condition(self, namespace: str, name: str, condition: PodCondition) -> None:
        body = {"status": {"conditions": [msgspec.to_builtins(condition)]}}
        path = f"/api/v1/namespaces/{_segment(namespace)}/pods/{_segment(name)}/status"
        await self._write("PATCH", path, body, STRATEGIC_MERGE)


def _segment(value: str) -> str:
    return quote(value, safe="")


async def _lines(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """JSON lines of a watch response, however the chunks split them (objects may be large)."""
    buffer = bytearray()
    async for chunk in response.content.iter_any():
        buffer.extend(chunk)
        start = 0
        while (end := buffer.find(b"\n", start)) >= 0:
            line = bytes(buffer[start:end]).strip()
            start = end + 1
            if line:
                yield line
        del buffer[:start]
    tail = bytes(buffer).strip()
    if tail:
        yield tail
