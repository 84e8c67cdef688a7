"""The pages in a real browser (headless Chromium, JavaScript off) while the demo's events flow:
the overview lists the keys and charts the history, a key page shows answers and superseded
resolutions (with what superseded each), a primary's task page what it superseded, and task ids
lead to the Taskcluster UI (the emulator's task page); the pages refresh themselves.
Screenshots go to the test's ``tmp_path``.

The browser is Debian's ``chromium`` (``scripts/with_services.py`` installs it and sets
``COALESCER_TEST_CHROMIUM``), driven by Playwright; Playwright's own browser builds are not used.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from playwright.async_api import Page, Route, async_playwright, expect

from tests.integration.test_demo import RAN, DemoProcess

ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def chromium() -> str:
    found = os.environ.get("COALESCER_TEST_CHROMIUM") or shutil.which("chromium")
    if not found:
        pytest.fail(
            "no Chromium: run the tests through scripts/with_services.py, which installs it"
        )
    return found


async def shot(page: Page, tmp_path: Path, name: str) -> None:
    await page.screenshot(path=str(tmp_path / f"{name}.png"), full_page=True)


REFRESH = re.compile(r'<meta http-equiv="refresh"[^>]*>')


async def without_refresh(route: Route) -> None:
    """A page as served, without its meta refresh."""
    if route.request.resource_type != "document":
        await route.continue_()
        return
    response = await route.fetch()
    body = await response.text()
    assert route.request.url.startswith("http://127.0.0.1:")  # the demo's own pages only
    await route.fulfill(response=response, body=REFRESH.sub("", body))


#: The overview's charts, by the history series each draws.
SERIES = ("pending", "superseded", "saved_ms", "answers")


async def figures(page: Page, series: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Per chart: its caption, its points (of lines and dots), how many of them are above
    the x axis (not 0), its bars and their titles."""
    out = {}
    for name in series:
        svg = page.locator(f"svg.chart[data-series='{name}']")
        await expect(svg).to_have_count(1)
        lines = await svg.locator("polyline").evaluate_all(
            "ls => ls.map(l => l.getAttribute('points'))"
        )
        dots = await svg.locator("circle").evaluate_all("cs => cs.map(c => c.getAttribute('cy'))")
        axis = float(await svg.locator("line.axis").first.get_attribute("y1") or 0)
        heights = [float(p.split(",")[1]) for points in lines for p in points.split()]
        heights += [float(y) for y in dots]
        titles = await svg.locator("rect title").all_text_contents()
        caption = page.locator("figure", has=svg).locator("figcaption")
        out[name] = {
            "title": await caption.text_content(),
            "points": len(heights),
            "raised": sum(1 for y in heights if y < axis),
            "bars": len(titles),
            "titles": titles,
        }
    return out


async def charted(
    page: Page, url: str, series: tuple[str, ...], within: float = 60.0
) -> dict[str, dict[str, Any]]:
    """The charts of the page at ``url`` once every one of ``series`` has drawn something
    other than 0 (the history fills as the demo runs; the upkeep samples every 15 s)."""
    give_up = time.monotonic() + within
    while True:
        await page.goto(url)
        found = await figures(page, series)
        if all(f["raised"] or f["bars"] for f in found.values()):
            return found
        if time.monotonic() > give_up:
            raise AssertionError(f"charts still empty after {within} s: {found}")
        await asyncio.sleep(1)


@pytest.mark.integration
@pytest.mark.timeout(150)
async def test_the_pages_in_a_browser_while_events_flow(tmp_path: Path) -> None:
    executable = chromium()
    demo = await DemoProcess(tmp_path, "--duration", "120", "--interval", "0.7").start()
    try:
        await demo.wait_for(f"Open {demo.service}/", within=40)
        primary = await demo.wait_for(RAN, within=40)
        async with async_playwright() as p:
            browser = await p.chromium.launch(executable_path=executable, args=ARGS)
            context = await browser.new_context(
                java_script_enabled=False, viewport={"width": 1280, "height": 900}
            )
            page = await context.new_page()

            blocked: list[str] = []
            page.on(
                "console", lambda m: blocked.append(m.text) if "Security Policy" in m.text else None
            )
            await page.goto(demo.service + "/")
            await expect(page).to_have_title("coalescer · keys")
            # The stylesheet is applied: the Content-Security-Policy allows it by its hash.
            await expect(page.locator("header")).to_have_css("background-color", "rgb(29, 35, 48)")
            rows = page.locator("tbody tr")
            await expect(rows).to_have_count(3)
            for key in ("linux64-tests", "windows11-tests", "macos-build"):
                await expect(page.get_by_role("link", name=key, exact=True)).to_be_visible()
            await shot(page, tmp_path, "overview")
            # The page reloads itself (meta refresh, no JavaScript).
            async with page.expect_navigation(timeout=15_000):
                pass
            # From here on, pages come without it: a refresh in the middle of a navigation or
            # a click aborts it (net::ERR_ABORTED) or detaches what the test looks at.
            await page.route("**/*", without_refresh)

            # The charts, once superseding has saved worker time (a key's superseded tasks
            # count the run time of its completed runs) and the upkeep has sampled the pending.
            charts = await charted(page, demo.service + "/", SERIES)
            for series, figure in charts.items():
                assert figure["title"], series
            assert charts["pending"]["raised"] >= 1
            assert charts["superseded"]["bars"] >= 1 and charts["answers"]["bars"] >= 1
            assert charts["saved_ms"]["bars"] >= 1
            assert all("UTC: " in t for t in charts["superseded"]["titles"])
            superseded = sum(int(t.rsplit(" ", 1)[1]) for t in charts["superseded"]["titles"])
            assert superseded >= int(primary.group(3))
            await shot(page, tmp_path, "charts")

            await page.get_by_role("link", name=primary.group(1), exact=True).click()
            await expect(page.locator("h1")).to_contain_text(primary.group(1))
            assert await page.locator('meta[http-equiv="refresh"]').count() == 0  # routed
            keyed = await charted(page, page.url, ("pending",))
            assert keyed["pending"]["raised"] >= 1
            answers = page.locator("h2:has-text('Recent answers') + table tbody tr")
            await expect(answers.first).to_be_visible()
            await expect(page.locator("td .pill.ok").first).to_be_visible()
            superseded = page.locator("h2:has-text('Recent resolutions') + table .pill.superseded")
            await expect(superseded.first).to_have_text("superseded")
            # ... each with the task that superseded it, on this service's pages.
            by = page.locator(
                "h2:has-text('Recent resolutions') + table tr:has(.pill.superseded) td:nth-child(5)"
            )
            await expect(by.first.locator("a.mono")).to_have_attribute(
                "href", re.compile("^/tasks/")
            )
            await shot(page, tmp_path, "key")

            await page.goto(primary.group(5))
            await expect(page.locator(".verdict")).to_contain_text("likely primary")
            crumbs = page.locator("nav.crumbs a")
            await expect(crumbs).to_have_text(["Keys", primary.group(1)])
            await expect(page.locator("table .pill.superseded").first).to_be_visible()
            await shot(page, tmp_path, "task")

            victim = page.locator("table td a.mono").first
            await victim.click()
            await expect(page.locator(".verdict")).to_contain_text("Superseded")
            await shot(page, tmp_path, "superseded-task")

            # Task ids link to the Taskcluster UI: in the demo, the emulator's task page.
            await page.locator("h1 a.ext").click()
            await expect(page.locator("h1")).to_have_text(f"demo {primary.group(1)}")
            await expect(page.get_by_text("exception")).not_to_have_count(0)
            await shot(page, tmp_path, "taskcluster-task")
            await browser.close()
            assert blocked == []
    finally:
        await demo.stop()
    for name in ("overview", "charts", "key", "task", "superseded-task", "taskcluster-task"):
        assert (tmp_path / f"{name}.png").stat().st_size > 10_000
