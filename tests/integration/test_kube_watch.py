"""The adapter's list+watch against kmock: resume after drops, re-list after 410 Gone, bookmarks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import kmock
from kube_harness import FAST_WATCH

from gpupool.kube.adapter import KubernetesAsyncioApi
from gpupool.kube.records import Change, Node, Synced


def node(name: str, version: str, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "resourceVersion": version, "labels": labels}}


def listing(version: str, *items: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "NodeList", "metadata": {"resourceVersion": version}, "items": list(items)}


def event(kind: str, obj: dict[str, Any]) -> dict[str, Any]:
    return {"type": kind, "object": obj}


def bookmark(version: str) -> dict[str, Any]:
    return event("BOOKMARK", {"kind": "Node", "metadata": {"resourceVersion": version}})


GONE = event(
    "ERROR",
    {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "code": 410,
        "reason": "Expired",
        "message": "too old resource version: 12 (18)",
    },
)


class ScriptedServer:
    """Answers the n-th node list / watch request with the n-th scripted response."""

    def __init__(self, lists: list[dict[str, Any]]) -> None:
        self.lists = lists
        self.list_params: list[dict[str, str]] = []
        self.watch_params: list[dict[str, str]] = []

    def answer_list(self, request: kmock.Request) -> dict[str, Any]:
        self.list_params.append(dict(request.params))
        return self.lists[len(self.list_params) - 1]

    def answer_watch(self, request: kmock.Request) -> Any:
        self.watch_params.append(dict(request.params))
        return self._watches(request)[len(self.watch_params) - 1]

    def _watches(self, request: kmock.Request) -> list[Any]:
        return [
            # 1: a change and a bookmark, then the server ends the stream (its timeout)
            (event("MODIFIED", node("n1", "11", zone="b")), bookmark("12")),
            # 2: a change, then the connection drops mid-stream
            self._drop_after(event("MODIFIED", node("n2", "13", zone="b")), request),
            # 3: the resume point is too old: re-list
            (GONE,),
            # 4: a new node, then the stream ends (5 is answered with HTTP 410, in the test)
            (event("ADDED", node("n4", "22")),),
        ]

    async def _drop_after(self, line: dict[str, Any], request: kmock.Request) -> AsyncIterator[Any]:
        yield line
        transport = request._raw_request.transport if request._raw_request else None
        assert transport is not None
        transport.close()


async def test_watch_resumes_after_drops_and_relists_after_gone(
    kmock: kmock.KubernetesEmulator,
) -> None:
    script = ScriptedServer(
        lists=[
            listing("10", node("n1", "5"), node("n2", "6")),
            # after the first 410: n2 was deleted and n3 created meanwhile; n1 as last seen
            listing("21", node("n1", "11", zone="b"), node("n3", "20")),
            # after the HTTP 410: n4 changed meanwhile
            listing("25", node("n1", "11", zone="b"), node("n3", "20"), node("n4", "24", zone="c")),
        ]
    )
    kmock.resources["v1/nodes"] = {}
    nodes = kmock.resource("", "v1", "nodes")
    kmock[kmock.action.LIST, nodes] << script.answer_list
    fifth_watch = kmock[kmock.action.WATCH, nodes, kmock.params(resourceVersion="22")]
    fifth_watch << 410 << GONE["object"]
    kmock[kmock.action.WATCH, nodes] << script.answer_watch

    seen: list[tuple[str, str, str]] = []
    async with await KubernetesAsyncioApi.connect(
        host=str(kmock.url), watch_settings=FAST_WATCH
    ) as api:
        changes = api.watch_nodes()
        async with asyncio.timeout(10):
            async for item in changes:
                if isinstance(item, Synced):
                    seen.append(("SYNCED", item.resource_version, ""))
                    continue
                assert isinstance(item, Change) and isinstance(item.object, Node)
                seen.append((item.type, item.object.name, item.object.metadata.resource_version))
                if item.object.name == "n4" and item.type == "MODIFIED":
                    break
        await changes.aclose()

    assert seen == [
        ("ADDED", "n1", "5"),
        ("ADDED", "n2", "6"),
        ("SYNCED", "10", ""),
        ("MODIFIED", "n1", "11"),
        ("MODIFIED", "n2", "13"),
        # 410 Gone: re-listed and compared with what was known
        ("DELETED", "n2", "13"),
        ("ADDED", "n3", "20"),
        ("SYNCED", "21", ""),
        ("ADDED", "n4", "22"),
        # HTTP 410 on reconnect: listed again
        ("MODIFIED", "n4", "24"),
    ]
    assert len(script.list_params) == 3
    assert all(p == {"limit": "500"} for p in script.list_params)
    assert [p.get("resourceVersion") for p in script.watch_params] == [
        "10",  # from the first list
        "12",  # the bookmark, after the server ended the stream
        "13",  # the last event, after the connection dropped
        "21",  # from the re-list after 410 Gone
    ]
    assert len(fifth_watch) == 1  # resourceVersion 22 → HTTP 410
    assert all(
        p["watch"] == "true" and p["allowWatchBookmarks"] == "true" for p in script.watch_params
    )


async def test_a_replayed_object_is_not_reported_twice(kmock: kmock.KubernetesEmulator) -> None:
    """An ADDED for an object already known at the same resourceVersion (a replay) is dropped."""
    script = ScriptedServer(lists=[listing("3", node("n1", "2"))])
    kmock.resources["v1/nodes"] = {}
    nodes = kmock.resource("", "v1", "nodes")
    kmock[kmock.action.LIST, nodes] << script.answer_list
    released = asyncio.Event()

    async def replay(request: kmock.Request) -> AsyncIterator[Any]:
        yield event("ADDED", node("n1", "2"))
        yield event("MODIFIED", node("n1", "4", zone="z"))
        await released.wait()

    kmock[kmock.action.WATCH, nodes] << replay
    async with await KubernetesAsyncioApi.connect(
        host=str(kmock.url), watch_settings=FAST_WATCH
    ) as api:
        changes = api.watch_nodes()
        received = [await anext(changes) for _ in range(3)]
        released.set()
        await changes.aclose()
    kinds = [
        (c.type, c.object.metadata.resource_version) for c in received if isinstance(c, Change)
    ]
    assert kinds == [("ADDED", "2"), ("MODIFIED", "4")]
