"""The console's HTTP layer (Starlette): four pages rendered server-side by Jinja2, and one
server-sent-events stream per open page that pushes its live part again whenever the log
grows (and every few seconds, so that waits advance with the clock).

Pages: ``/`` (the cluster), ``/nodes/{node}``, ``/pods/{namespace}/{name}``,
``/gpus?node=&since=&until=`` (the GPU timeline; with ``until`` it is a fixed past
window, rebuilt from the log like ``gpupool state --at``). Everything is read-only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from jinja2 import Environment, FileSystemLoader, select_autoescape
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, Response
from starlette.routing import Route

from gpupool.audit import AuditError
from gpupool.console.feed import LogFeed
from gpupool.console.pages import (
    HELPERS,
    Page,
    clock,
    cluster_page,
    gpus_page,
    node_page,
    pod_page,
)
from gpupool.eventlog.port import Entry

TEMPLATES = Path(__file__).parent / "templates"
TICK_S = 2.0
"""How often a live page is pushed again when no entry arrives (waits grow with the clock)."""

PageMaker = Callable[[list[Entry], datetime], Page]


def environment() -> Environment:
    env = Environment(
        loader=FileSystemLoader(TEMPLATES),
        autoescape=select_autoescape(["html"]),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.globals.update(HELPERS)
    return env


def page_maker(path: str, query: dict[str, list[str]]) -> PageMaker | None:
    """Which page a path names (the same routing for the page and its live stream)."""
    parts = [unquote(p) for p in path.strip("/").split("/") if p]

    def first(name: str) -> str | None:
        values = query.get(name)
        return values[0] if values and values[0] else None

    match parts:
        case []:
            return cluster_page
        case ["nodes", name]:
            return lambda entries, now: node_page(entries, name, now)
        case ["pods", namespace, name]:
            return lambda entries, now: pod_page(entries, f"{namespace}/{name}", now)
        case ["gpus"]:
            return lambda entries, now: gpus_page(
                entries, now, node=first("node"), since=first("since"), until=first("until")
            )
    return None


class Console:
    def __init__(self, feed: LogFeed, *, tick: float = TICK_S) -> None:
        self.feed = feed
        self.tick = tick
        self.env = environment()

    def render_live(self, page: Page) -> str:
        return self.env.get_template(page.template + ".html").render(**page.context)

    def render_page(self, page: Page) -> str:
        context = {"live": True, **page.context}
        return self.env.get_template("base.html").render(
            **context,
            template=page.template,
            title=page.title,
            source=self.feed.description,
            version=self.feed.version,
        )

    async def page(self, request: Request) -> Response:
        maker = page_maker(request.url.path, parse_qs(request.url.query))
        if maker is None:
            return PlainTextResponse("no such page", status_code=404)
        try:
            page = maker(self.feed.entries, clock())
        except AuditError as exc:
            return PlainTextResponse(str(exc), status_code=404)
        return HTMLResponse(self.render_page(page))

    async def live(self, request: Request) -> Response:
        target = urlsplit(request.query_params.get("page", "/"))
        maker = page_maker(target.path, parse_qs(target.query))
        if maker is None:
            return PlainTextResponse("no such page", status_code=404)
        return EventSourceResponse(self._updates(maker), ping=15)

    async def _updates(self, maker: PageMaker) -> AsyncIterator[dict[str, Any]]:
        version = -1
        while True:
            if version >= 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.tick):
                        version = await self.feed.wait_after(version)
            version = max(version, self.feed.version)
            try:
                html = self.render_live(maker(self.feed.entries, clock()))
            except AuditError as exc:
                html = f"<p class='muted'>{exc}</p>"
            yield {"event": "page", "data": json.dumps({"html": html, "version": version})}

    async def healthz(self, _request: Request) -> Response:
        return PlainTextResponse(f"ok, {len(self.feed.entries)} entries\n")


def create_app(
    feed: LogFeed, *, tick: float = TICK_S, on_ready: Callable[[], None] | None = None
) -> Starlette:
    console = Console(feed, tick=tick)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        await feed.start()
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            await feed.close()

    return Starlette(
        routes=[
            Route("/healthz", console.healthz),
            Route("/live", console.live),
            Route("/", console.page),
            Route("/nodes/{name}", console.page),
            Route("/pods/{namespace}/{name}", console.page),
            Route("/gpus", console.page),
        ],
        lifespan=lifespan,
    )
