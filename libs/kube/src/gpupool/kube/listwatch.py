"""List, then watch, forever, the way client-go's reflector does.

* The first list (paged) yields ADDED for every object, then ``Synced``.
* The watch starts at the list's resourceVersion and asks for bookmarks.
  Every event (and every BOOKMARK) moves the resume point forward.
* A watch that ends or drops (server timeout, broken connection) is reopened
  at the last resourceVersion seen: nothing is listed again, nothing missed.
* ``410 Gone`` (an ERROR event or the HTTP status: the resume point is too old)
  re-lists. The re-list is compared with what is known: vanished objects yield
  DELETED, new ones ADDED, changed ones MODIFIED, then ``Synced``.
* Other failures back off (doubling, capped) and reopen at the same point.

The HTTP side is a small ``WatchTransport``; :mod:`gpupool.kube.adapter` gives
one over kubernetes-asyncio.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Generic, Protocol, TypeVar

import aiohttp
import msgspec

from gpupool.kube.port import KubernetesApiError
from gpupool.kube.records import Change, ChangeType, ObjectMeta, Synced

log = logging.getLogger(__name__)

Params = Sequence[tuple[str, str]]


class WatchSettings(msgspec.Struct, frozen=True, kw_only=True):
    page_size: int = 500
    timeout_seconds: int = 300
    """Server-side end of each watch request; it is then reopened at the last resourceVersion."""
    initial_backoff_seconds: float = 0.2
    max_backoff_seconds: float = 10.0


class WatchTransport(Protocol):
    async def get(self, path: str, params: Params) -> bytes:
        """GET ``path``; raise KubernetesApiError for a non-2xx answer."""
        ...

    def stream(
        self, path: str, params: Params
    ) -> AbstractAsyncContextManager[AsyncIterator[bytes]]:
        """GET ``path`` as a stream of JSON lines; raise KubernetesApiError for a non-2xx answer."""
        ...


class HasMetadata(Protocol):
    @property
    def metadata(self) -> ObjectMeta: ...


T = TypeVar("T", bound=HasMetadata)


class ListMeta(msgspec.Struct, frozen=True, kw_only=True):
    resource_version: str = msgspec.field(default="", name="resourceVersion")
    continue_token: str = msgspec.field(default="", name="continue")


class ObjectList(msgspec.Struct, Generic[T], frozen=True, kw_only=True):
    metadata: ListMeta = ListMeta()
    items: list[T] = []


class WatchLine(msgspec.Struct, frozen=True, kw_only=True):
    type: str
    object: msgspec.Raw


class Status(msgspec.Struct, frozen=True, kw_only=True):
    code: int = 0
    reason: str = ""
    message: str = ""


class Bookmark(msgspec.Struct, frozen=True, kw_only=True):
    metadata: ObjectMeta


class WatchBroken(Exception):
    """The watch stream said ERROR (other than 410) or sent something unreadable."""


_WATCH_LINE = msgspec.json.Decoder(WatchLine)
_STATUS = msgspec.json.Decoder(Status)
_BOOKMARK = msgspec.json.Decoder(Bookmark)


def object_key(meta: ObjectMeta) -> str:
    return f"{meta.namespace}/{meta.name}" if meta.namespace else meta.name


class Reflector(Generic[T]):
    """What the watcher knows, to turn re-lists into changes and drop replayed duplicates."""

    def __init__(self) -> None:
        self.known: dict[str, T] = {}

    def relist(self, items: list[T]) -> list[Change[T]]:
        fresh = {object_key(item.metadata): item for item in items}
        changes: list[Change[T]] = [
            Change(type="DELETED", object=old)
            for key, old in self.known.items()
            if key not in fresh
        ]
        for key, item in fresh.items():
            old = self.known.get(key)
            if old is None:
                changes.append(Change(type="ADDED", object=item))
            elif _changed(old, item):
                changes.append(Change(type="MODIFIED", object=item))
        self.known = fresh
        return changes

    def observe(self, kind: ChangeType, item: T) -> Change[T] | None:
        key = object_key(item.metadata)
        old = self.known.get(key)
        if kind == "DELETED":
            if old is None:
                return None
            del self.known[key]
            return Change(type="DELETED", object=item)
        self.known[key] = item
        if old is None:
            return Change(type="ADDED", object=item)
        if not _changed(old, item):
            return None
        return Change(type="MODIFIED", object=item)


def _changed(old: HasMetadata, new: HasMetadata) -> bool:
    """Same non-empty resourceVersion: the same object (a replay); otherwise assume it changed."""
    version = new.metadata.resource_version
    return not version or version != old.metadata.resource_version


class ListWatcher(Generic[T]):
    def __init__(
        self,
        transport: WatchTransport,
        path: str,
        object_type: type[T],
        *,
        settings: WatchSettings | None = None,
    ) -> None:
        self._transport = transport
        self._path = path
        self._settings = settings or WatchSettings()
        self._list_decoder = msgspec.json.Decoder(ObjectList[object_type])  # type: ignore[valid-type]
        self._object_decoder = msgspec.json.Decoder(object_type)
        self.reflector: Reflector[T] = Reflector()
        self.resource_version = ""

    async def _list(self) -> list[T]:
        items: list[T] = []
        token = ""
        while True:
            params = [("limit", str(self._settings.page_size))]
            if token:
                params.append(("continue", token))
            page = self._list_decoder.decode(await self._transport.get(self._path, params))
            items.extend(page.items)
            token = page.metadata.continue_token
            if not token:
                self.resource_version = page.metadata.resource_version
                return items

    def _watch_params(self) -> Params:
        params = [
            ("watch", "true"),
            ("allowWatchBookmarks", "true"),
            ("timeoutSeconds", str(self._settings.timeout_seconds)),
        ]
        if self.resource_version:
            params.append(("resourceVersion", self.resource_version))
        return params

    async def changes(self) -> AsyncIterator[Change[T] | Synced]:
        backoff = self._settings.initial_backoff_seconds
        listed = False
        while True:
            try:
                if not listed:
                    items = await self._list()
                    for relisted in self.reflector.relist(items):
                        yield relisted
                    yield Synced(resource_version=self.resource_version)
                    listed = True
                heard = False
                async with self._transport.stream(self._path, self._watch_params()) as lines:
                    async for line in lines:
                        heard = True
                        change, gone = self._read(line)
                        if gone:
                            log.info(
                                "%s: resourceVersion %s is gone; listing again",
                                self._path,
                                self.resource_version,
                            )
                            listed = False
                            break
                        backoff = self._settings.initial_backoff_seconds
                        if change is not None:
                            yield change
                if heard:
                    continue
                log.debug("%s: watch ended without a word; reopening in %.1fs", self._path, backoff)
            except KubernetesApiError as exc:
                if exc.status == 410:
                    log.info("%s: HTTP 410; listing again", self._path)
                    listed = False
                    continue
                log.warning("%s: %s; retrying in %.1fs", self._path, exc, backoff)
            except (aiohttp.ClientError, TimeoutError, WatchBroken, msgspec.DecodeError) as exc:
                log.warning("%s: watch broke (%r); retrying in %.1fs", self._path, exc, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._settings.max_backoff_seconds)

    def _read(self, line: bytes) -> tuple[Change[T] | None, bool]:
        """The change a watch line carries (None for bookmarks and replays); True when 410 Gone."""
        event = _WATCH_LINE.decode(line)
        if event.type == "ERROR":
            status = _STATUS.decode(event.object)
            if status.code == 410:
                return None, True
            raise WatchBroken(f"watch error {status.code} {status.reason}: {status.message}")
        if event.type == "BOOKMARK":
            bookmark = _BOOKMARK.decode(event.object)
            self.resource_version = bookmark.metadata.resource_version or self.resource_version
            return None, False
        if event.type not in ("ADDED", "MODIFIED", "DELETED"):
            raise WatchBroken(f"unknown watch event type {event.type!r}")
        item = self._object_decoder.decode(event.object)
        self.resource_version = item.metadata.resource_version or self.resource_version
        kind: ChangeType = event.type  # type: ignore[assignment]
        return self.reflector.observe(kind, item), False
