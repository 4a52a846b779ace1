"""The web console in headless Chromium (Debian's ``chromium``, driven by Playwright).

The worked example is played live through a real stack (nats-server, the four
services, real ``gpupool run`` workloads on two simulated GPUs) while the node page
is open: at T1 it shows D at position 1 and B at 2; when C completes it shows D on
GPU 1 and B on GPU 0 without a reload. The GPU timeline of the finished run shows
the four intervals in order on the right GPUs. A preemption scenario's timeline
(from a simulated log) marks the preemption.

Screenshots are saved as test artefacts under ``$GPUPOOL_TEST_ARTIFACTS`` (default
``.artifacts/console``); with ``GPUPOOL_WRITE_DOCS_SCREENSHOTS=1`` they also replace
the ones in docs/ (that is how docs/console-*.png are made).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from playwright.async_api import Browser, Page, async_playwright
from stack_harness import running_stack

from gpupool.cli.demo import NODE, DemoRun
from gpupool.cli.main import main
from gpupool.events import Assigned, PodReady, Released

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--no-first-run",
]
ARTIFACTS = Path(os.environ.get("GPUPOOL_TEST_ARTIFACTS", ROOT / ".artifacts" / "console"))
WITHIN_MS = 30_000

pytestmark = pytest.mark.timeout(300)


@contextlib.asynccontextmanager
async def console(*source: str) -> AsyncIterator[str]:
    """``gpupool console`` as a process on a free loopback port: its base URL."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gpupool.cli.main",
        "console",
        *source,
        "--port",
        "0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert process.stdout is not None
    try:
        async with asyncio.timeout(60):
            line = (await process.stdout.readline()).decode()
        assert line.startswith("gpupool console: serving http://127.0.0.1:"), line
        yield line.split()[-1].rstrip("/")
    finally:
        process.terminate()
        await process.wait()


@contextlib.asynccontextmanager
async def chromium() -> AsyncIterator[Browser]:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: the setup (scripts/install-chromium.sh) installs it")
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS
        )
        try:
            yield browser
        finally:
            await browser.close()


async def screenshot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    target = ARTIFACTS / f"console-{name}.png"
    await page.screenshot(path=str(target), full_page=True)
    if os.environ.get("GPUPOOL_WRITE_DOCS_SCREENSHOTS") == "1":
        shutil.copyfile(target, ROOT / "docs" / f"console-{name}.png")


async def interval_rows(page: Page) -> list[tuple[str, str, str]]:
    rows = page.locator("#intervals tr[data-pod]")
    return [
        (
            await rows.nth(i).get_attribute("data-pod") or "",
            await rows.nth(i).get_attribute("data-gpu") or "",
            await rows.nth(i).get_attribute("data-ended") or "",
        )
        for i in range(await rows.count())
    ]


async def test_node_page_follows_the_worked_example_live(tmp_path: Path) -> None:
    cluster = (ROOT / "scenarios" / "worked-example.yaml").read_text()
    async with (
        running_stack(tmp_path, cluster, NODE, gpus=2) as stack,
        console("--nats", stack.nats_url) as base,
        chromium() as browser,
    ):
        page = await browser.new_page(viewport={"width": 1200, "height": 800})
        run = DemoRun(stack=stack, out=open(os.devnull, "w"))  # noqa: SIM115
        follower = asyncio.create_task(run.follow_log())
        try:
            await page.goto(f"{base}/nodes/{NODE}")
            await page.evaluate("window.notReloaded = true")

            await run.start_pod("pod-a")
            await run.until("A runs", lambda: run.has(Assigned, "pod-a"))
            await run.start_pod("pod-c")
            await run.until("C runs", lambda: run.has(Assigned, "pod-c"))
            await run.start_pod("pod-d")
            await run.until("D queued", lambda: run.has(PodReady, "pod-d"))
            await run.start_pod("pod-b")
            await run.until("B queued", lambda: run.has(PodReady, "pod-b"))

            # T1: the page shows D at position 1, B at position 2, A and C on their GPUs
            await page.locator('#queue tr[data-pod="default/pod-d"][data-position="1"]').wait_for(
                timeout=WITHIN_MS
            )
            await page.locator('#queue tr[data-pod="default/pod-b"][data-position="2"]').wait_for(
                timeout=WITHIN_MS
            )
            assert await page.locator("#queue tr[data-pod]").count() == 2
            assert await page.locator('[data-gpu="0"] li[data-pod="default/pod-a"]').count() == 1
            assert await page.locator('[data-gpu="1"] li[data-pod="default/pod-c"]').count() == 1
            await screenshot(page, "node")
            overview = await browser.new_page(viewport={"width": 1200, "height": 500})
            await overview.goto(f"{base}/")
            row = overview.locator(f'#nodes tr[data-node="{NODE}"]')
            assert await row.locator('td[data-queue-length="2"]').count() == 1
            await screenshot(overview, "cluster")
            await overview.close()

            # T2: C completes; D gets GPU 1, B GPU 0 beside A; the page follows without a reload
            await run.pods["pod-c"].finish()
            await page.locator('[data-gpu="1"] li[data-pod="default/pod-d"]').wait_for(
                timeout=WITHIN_MS
            )
            await page.locator('[data-gpu="0"] li[data-pod="default/pod-b"]').wait_for(
                timeout=WITHIN_MS
            )
            await page.locator("#queue-empty").wait_for(timeout=WITHIN_MS)
            assert await page.evaluate("window.notReloaded === true")

            for name in ("pod-a", "pod-d", "pod-b"):
                await run.pods[name].finish()
            await run.until(
                "all released", lambda: sum(isinstance(e.event, Released) for e in run.events) >= 4
            )

            # the GPU timeline of the finished run: four intervals, in order, on the right GPUs
            await page.goto(f"{base}/gpus?node={NODE}")
            # the console's feed may be a moment behind this test's own follower of the log;
            # the page follows it live: wait until it shows the last release
            await page.locator(
                '#intervals tr[data-pod="default/pod-b"][data-ended="completed"]'
            ).wait_for(timeout=WITHIN_MS)
            assert await interval_rows(page) == [
                ("default/pod-a", "0", "completed"),
                ("default/pod-c", "1", "completed"),
                ("default/pod-d", "1", "completed"),
                ("default/pod-b", "0", "completed"),
            ]
            assert await page.locator("#chart svg #interval-3").count() == 1
            await screenshot(page, "gpu-timeline")

            await page.goto(f"{base}/pods/default/pod-b")
            kinds = page.locator("#steps tr[data-kind]")
            assert [
                await kinds.nth(i).get_attribute("data-kind") for i in range(await kinds.count())
            ] == ["registered", "ready", "moved", "assigned", "released"]
            await screenshot(page, "pod")
        finally:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower
            for pod in run.pods.values():
                if pod.process.returncode is None:
                    pod.process.kill()
                    await pod.process.wait()


async def test_gpu_timeline_marks_a_preemption_in_a_past_window(tmp_path: Path) -> None:
    log = tmp_path / "pp.jsonl"
    assert (
        main(["simulate", str(ROOT / "scenarios" / "preemption-priority.yaml"), "-o", str(log)])
        == 0
    )
    async with console("--log", str(log)) as base, chromium() as browser:
        page = await browser.new_page(viewport={"width": 1200, "height": 800})
        await page.goto(f"{base}/gpus?since=%2B0s&until=%2B80s")
        assert await interval_rows(page) == [
            ("default/train-1", "0", "preempted"),
            ("default/train-2", "1", "completed"),
            ("serving/infer", "0", "holding"),
            ("default/train-1", "1", "holding"),
        ]
        assert await page.locator("#chart svg #preempted-0").count() == 1
        assert "serving/infer" in await page.locator("#preemptions").inner_text()
        await screenshot(page, "gpu-timeline-preemption")
