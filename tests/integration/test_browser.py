"""The pages in a real browser (headless Chromium, JavaScript off) while the demo's events flow:
the overview lists the keys, a key page shows answers and superseded resolutions, a primary's
task page what it superseded; the pages refresh themselves. Screenshots go to the test's
``tmp_path``.

The browser is Debian's ``chromium`` (``scripts/with_services.py`` installs it and sets
``COALESCER_TEST_CHROMIUM``), driven by Playwright; Playwright's own browser builds are not used.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from playwright.async_api import Page, async_playwright, expect

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

            await page.get_by_role("link", name=primary.group(1), exact=True).click()
            await expect(page.locator("h1")).to_contain_text(primary.group(1))
            answers = page.locator("h2:has-text('Recent answers') + table tbody tr")
            await expect(answers.first).to_be_visible()
            await expect(page.locator("td .pill.ok").first).to_be_visible()
            superseded = page.locator("h2:has-text('Recent resolutions') + table .pill.superseded")
            await expect(superseded.first).to_have_text("superseded")
            await shot(page, tmp_path, "key")

            await page.goto(primary.group(4))
            await expect(page.locator(".verdict")).to_contain_text("likely primary")
            await expect(page.locator("table .pill.superseded").first).to_be_visible()
            await shot(page, tmp_path, "task")

            victim = page.locator("table td a.mono").first
            await victim.click()
            await expect(page.locator(".verdict")).to_contain_text("Superseded")
            await shot(page, tmp_path, "superseded-task")
            await browser.close()
            assert blocked == []
    finally:
        await demo.stop()
    for name in ("overview", "key", "task", "superseded-task"):
        assert (tmp_path / f"{name}.png").stat().st_size > 10_000
