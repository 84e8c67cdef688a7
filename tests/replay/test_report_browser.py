"""The HTML report in headless Chromium with JavaScript off: the title, the side-by-side table
with both must-be-zero rows green, and the three charts drawn. The screenshot is kept in the
test's ``tmp_path`` (``report.png``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from playwright.async_api import async_playwright, expect

from coalescer.replay import metrics, report, runner, synthetic
from coalescer.store import open_store
from tests.conftest import REDIS_URL
from tests.integration.test_browser import ARGS, chromium

pytestmark = pytest.mark.integration


async def report_page() -> str:
    history = synthetic.generate(synthetic.Synthetic(hours=24))
    configs = [runner.Config(False), runner.Config(True, 3600, 5), runner.Config(True)]
    store = await open_store(REDIS_URL, grace_seconds=3600)
    try:
        outcomes = await runner.replay(history, configs, store)
    finally:
        await store.close()
    base = outcomes[0].worker_ms / 3_600_000
    summaries = tuple(
        metrics.summarize(history, c.name, o, base) for c, o in zip(configs, outcomes, strict=True)
    )
    return report.html(report.Report(history, summaries, 1.0))


@pytest.mark.timeout(90)
async def test_the_report_reads_well_in_a_browser(tmp_path: Path) -> None:
    page_file = tmp_path / "report.html"
    await asyncio.to_thread(page_file.write_text, await report_page())
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=chromium(), args=ARGS)
        context = await browser.new_context(
            java_script_enabled=False, viewport={"width": 1280, "height": 900}
        )
        page = await context.new_page()
        await page.goto(page_file.as_uri())
        await expect(page).to_have_title("coalescer · what-if replay")
        await expect(page.locator("h1")).to_have_text("What superseding would save and cost")
        header = page.locator("table").first.locator("thead th")
        await expect(header).to_have_text(
            ["", "off", "on-claim age>3600s size>5", "on-claim always"]
        )
        for row in ("wrong winners (must be 0)", "lost tasks (must be 0)"):
            cells = page.locator(f"tr:has(td:text-is('{row}')) td.good")
            await expect(cells).to_have_count(3)
        charts = page.locator("svg")
        await expect(charts).to_have_count(3)
        for n in range(3):
            box = await charts.nth(n).bounding_box()
            assert box is not None and box["width"] > 600 and box["height"] > 100
        await expect(page.locator("svg polyline")).to_have_count(6)
        await expect(page.locator("svg rect")).to_have_count(3)
        await page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
        await browser.close()
    assert (tmp_path / "report.png").stat().st_size > 50_000
