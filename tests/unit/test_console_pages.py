"""The console's pages and live stream, in process (the browser test drives the real thing).

Pages are rendered from the audit read models; the live stream pushes a page's live
part as soon as an entry arrives (the tick here is an hour: only the arrival can
have caused the push).
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from gpupool.cli.main import main
from gpupool.console.app import Console, page_maker
from gpupool.console.feed import FileFeed, LogFeed

ROOT = Path(__file__).resolve().parents[2]
NODE = "cn-wulanchabu-c.cr-xxx"
NOW = datetime(2025, 1, 1, 0, 0, 5, tzinfo=UTC)


@pytest.fixture(scope="module")
def we(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("logs") / "we.jsonl"
    assert (
        main(["simulate", str(ROOT / "scenarios" / "worked-example.yaml"), "-o", str(target)]) == 0
    )
    return target


async def loaded(path: Path) -> FileFeed:
    feed = FileFeed(path)
    await feed.start()
    return feed


async def test_node_page_at_t1_shows_the_queue_and_the_gpus(we: Path) -> None:
    feed = await loaded(we)
    t1 = [e for e in feed.entries if e.seq <= 12]
    maker = page_maker(f"/nodes/{NODE}", {})
    assert maker is not None
    html = Console(feed).render_page(maker(t1, NOW))
    assert '<tr data-pod="default/pod-d" data-position="1">' in html
    assert '<tr data-pod="default/pod-b" data-position="2">' in html
    assert 'new EventSource("/live?page="' in html


async def test_gpu_timeline_lists_the_intervals_in_order(we: Path) -> None:
    feed = await loaded(we)
    maker = page_maker("/gpus", {"node": [NODE]})
    assert maker is not None
    html = Console(feed).render_live(maker(feed.entries, NOW))
    order = [
        html.index(f'data-pod="default/{pod}" data-gpu="{gpu}"')
        for pod, gpu in (("pod-a", 0), ("pod-c", 1), ("pod-d", 1), ("pod-b", 0))
    ]
    assert order == sorted(order)
    assert 'id="interval-3"' in html and "<svg" in html


async def test_a_past_window_is_static(we: Path) -> None:
    feed = await loaded(we)
    maker = page_maker("/gpus", {"until": ["+5s"]})
    assert maker is not None
    html = Console(feed).render_page(maker(feed.entries, NOW))
    assert "EventSource" not in html
    assert 'data-pod="default/pod-d"' not in html  # D got its GPU only at +60s


def test_unknown_pages_are_not_routed() -> None:
    assert page_maker("/nowhere", {}) is None
    assert page_maker("/nodes", {}) is None


async def test_the_live_stream_pushes_when_an_entry_arrives(we: Path) -> None:
    complete = await loaded(we)
    feed = LogFeed()
    await feed.add([e for e in complete.entries if e.seq <= 12])
    console = Console(feed, tick=3600)
    maker = page_maker(f"/nodes/{NODE}", {})
    assert maker is not None
    updates = console._updates(maker)
    async with asyncio.timeout(10):
        first = json.loads((await anext(updates))["data"])
        assert 'data-pod="default/pod-b" data-position="2"' in first["html"]
        pending = asyncio.ensure_future(anext(updates))
        await asyncio.sleep(0)
        assert not pending.done()
        await feed.add([e for e in complete.entries if e.seq > 12])
        second = json.loads((await pending)["data"])
    assert second["version"] > first["version"]
    assert 'id="queue-empty"' in second["html"]
    assert '<li data-pod="default/pod-d"' in second["html"]
    await updates.aclose()
