"""The pages over time: charts of the history, what superseded each resolution, breadcrumbs,
orders as times, links to the Taskcluster UI."""

from __future__ import annotations

import dataclasses
import re
import time
from datetime import UTC, datetime
from typing import Any

import httpx
from starlette.applications import Starlette

from coalescer import history, upkeep
from coalescer.store import Store
from coalescer.store import history as stored
from coalescer.web.pages import order_text
from tests.conftest import make_message
from tests.web.conftest import HTML, ids, post, supersede_scenario

ROUTE = ("coalesce.v1.k",)


def iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")[:-6] + "Z"


def timed(task_id: str, state: str, *, started: int, resolved: int, **kw: Any) -> dict[str, Any]:
    """A message of a resolved run that started and resolved at the given times."""
    message = make_message(task_id, state, scheduled=iso(started - 1000), routes=ROUTE, **kw)
    run = message["payload"]["status"]["runs"][-1]
    run.update(started=iso(started), takenUntil=iso(resolved), resolved=iso(resolved))
    return message


def chart(page: str, series: str) -> str:
    found = re.search(rf'<svg class="chart"[^>]*data-series="{series}".*?</svg>', page, re.S)
    assert found, f"no {series} chart"
    return found[0]


def test_an_order_reads_as_the_time_its_task_was_scheduled_or_as_its_tag() -> None:
    assert order_text(1893456000123.0) == "scheduled 2030-01-01 00:00:00.123 UTC"
    assert order_text(1795423486394.0) == "scheduled 2026-11-23 08:44:46.394 UTC"
    assert order_text(4711.0, "pushId") == "pushId 4711"
    assert order_text(1e300) == "1e+300"  # no such time: the number


async def test_the_overview_charts_superseded_tasks_time_saved_answers_and_pending(
    client: httpx.AsyncClient, app: Starlette, store: Store
) -> None:
    now = int(time.time() * 1000)
    # Sampled two minutes ago, when nothing was pending, and at the end (carried between).
    await upkeep.count(store, now_ms=now - 120_000, retention=app.state.settings.retention)
    earlier, a, b, c = ids(4)
    await post(
        client,
        *(
            make_message(t, scheduled=iso(now - 60_000 + n * 1000), routes=ROUTE)
            for n, t in enumerate((earlier, a, b, c))
        ),
    )
    # A run of the key took 40 s: the estimate of what superseding one of its tasks saves.
    await post(client, timed(earlier, "completed", started=now - 50_000, resolved=now - 10_000))
    r = await client.get(f"/k?taskId={a}")
    assert r.json() == {"supersedes": [a, b, c]}
    await app.state.observer.flush()
    gone = [timed(t, "exception", started=now, resolved=now, reason="superseded") for t in (a, b)]
    for _ in range(2):  # delivered twice: counted once
        await post(client, *gone)
    await upkeep.count(store, now_ms=now, retention=app.state.settings.retention)

    found = await stored.read(store, app.state.settings.retention, now_ms=now)
    assert found[history.SUPERSEDED].total == 2
    assert found[history.SAVED_MS].total == 80_000
    assert found[history.ANSWERS].total == 1
    assert found[history.PENDING].latest == 1  # c

    page = (await client.get("/", headers=HTML)).text
    assert len(re.findall(r'<svg class="chart"', page)) == 4
    superseded = chart(page, "superseded")
    assert re.findall(r"<rect[^>]*><title>[^<]*UTC: 2</title>", superseded)
    saved = chart(page, "saved_ms")
    assert re.findall(r"<title>[^<]*UTC: 80 s</title>", saved)
    assert len(re.findall(r"<rect[^>]*><title>[^<]*UTC: 1</title>", chart(page, "answers"))) == 1
    pending = re.search(r'<polyline points="([^"]+)"', chart(page, "pending"))
    assert pending
    heights = [float(p.split(",")[1]) for p in pending[1].split()]
    assert len(heights) == 3 and heights[0] == heights[1] > heights[2]  # 0, 0, then 1
    assert "Tasks superseded <span>· 2 in the last" in page
    assert "<script" not in page


async def test_a_key_page_charts_its_pending_tasks(
    client: httpx.AsyncClient, app: Starlette, store: Store
) -> None:
    a, b = ids(2)
    await post(client, *(make_message(t, routes=ROUTE) for t in (a, b)))
    page = (await client.get("/k", headers=HTML)).text
    assert "nothing yet" in chart(page, "pending")
    await upkeep.count(store, retention=app.state.settings.retention)
    page = (await client.get("/k", headers=HTML)).text
    assert chart(page, "pending").count("<circle") == 1  # one sample: a dot
    assert "Pending tasks <span>· latest sample 2" in page
    # A key seen a minute ago spans minutes, not hours (its buckets are 5 min wide).
    hours = re.findall(r">(\d\d:\d\d)<", chart(page, "pending"))
    first, last = (int(h[:2]) * 60 + int(h[3:]) for h in (hours[0], hours[-1]))
    assert (last - first) % 1440 <= 15, hours


async def test_each_superseded_resolution_links_to_what_superseded_it(
    client: httpx.AsyncClient, app: Starlette
) -> None:
    a, b, c, _ = await supersede_scenario(client, app)
    view = (await client.get("/k", headers=HTML)).text
    resolutions = view.split("<h2>Recent resolutions</h2>")[1]
    rows = {row.split("</td>")[1]: row for row in resolutions.split("<tr>")[2:]}
    for victim in (a, b):
        (row,) = [r for cell, r in rows.items() if victim in cell]
        assert row.split("</td>")[4].count(f'href="/tasks/{c}?key=k"') == 1
    (primary,) = [r for cell, r in rows.items() if c in cell]
    assert "/tasks/" not in primary.split("</td>")[4]


async def test_the_task_page_has_a_breadcrumb_and_its_order_as_a_time(
    client: httpx.AsyncClient, app: Starlette
) -> None:
    a, _, _, _ = await supersede_scenario(client, app)
    page = (await client.get(f"/tasks/{a}?key=k", headers=HTML)).text
    crumbs = re.search(r'<nav class="crumbs".*?</nav>', page, re.S)
    assert crumbs
    assert re.findall(r'href="(/[^"]*)"', crumbs[0]) == ["/", "/k"]
    assert crumbs[0].endswith(f"\u203a task {a}</nav>")
    assert "scheduled 2030-01-01 00:00:00.000 UTC" in page
    assert "1893456000000.0" not in page.replace('title="1893456000000.0"', "")


async def test_every_task_id_links_to_the_taskcluster_ui_when_a_root_url_is_known(
    client: httpx.AsyncClient, app: Starlette
) -> None:
    a, b, c, d = await supersede_scenario(client, app)
    app.state.settings = dataclasses.replace(
        app.state.settings, taskcluster_root_url="https://tc.example.com"
    )
    page = (await client.get("/k", headers=HTML)).text
    for task_id in (a, b, c, d):
        assert f'href="https://tc.example.com/tasks/{task_id}"' in page
    answers = page.split("<h2>Recent answers</h2>")[1].split("<h2>")[0]
    assert f'href="https://tc.example.com/tasks/{b}"' in answers
    page = (await client.get(f"/tasks/{a}", headers=HTML)).text
    assert f'href="https://tc.example.com/tasks/{c}"' in page


def tile(page: str, label: str) -> int:
    found = re.search(rf'<div class="stat"><b>([\d,]+)</b><span>{label}</span></div>', page)
    assert found, f"no {label!r} tile"
    return int(found[1].replace(",", ""))


def latest_sample(page: str) -> int:
    found = re.search(r"Pending tasks <span>· latest sample ([\d,]+)", page)
    assert found, "no pending chart with a sample"
    return int(found[1].replace(",", ""))


async def test_the_pending_tiles_and_charts_agree_once_counted_and_say_which_is_which(
    client: httpx.AsyncClient, app: Starlette, store: Store
) -> None:
    retention = app.state.settings.retention
    k_tasks, j_tasks = ids(3), ids(2)
    await post(client, *(make_message(t, routes=ROUTE) for t in k_tasks))
    await post(client, *(make_message(t, routes=("coalesce.v1.j",)) for t in j_tasks))
    await upkeep.count(store, retention=retention)

    overview = (await client.get("/", headers=HTML)).text
    assert tile(overview, "pending tasks") == latest_sample(overview) == 5
    key = (await client.get("/k", headers=HTML)).text
    assert tile(key, "pending now") == latest_sample(key) == 3

    # Two of k's tasks resolve: the key's tile counts now, its chart keeps the last sample,
    # each labelled as what it is, until the next count brings them together again.
    done = [make_message(t, "completed", routes=ROUTE) for t in k_tasks[:2]]
    await post(client, *done)
    key = (await client.get("/k", headers=HTML)).text
    assert (tile(key, "pending now"), latest_sample(key)) == (1, 3)
    await upkeep.count(store, retention=retention)
    overview = (await client.get("/", headers=HTML)).text
    assert tile(overview, "pending tasks") == latest_sample(overview) == 3
    key = (await client.get("/k", headers=HTML)).text
    assert tile(key, "pending now") == latest_sample(key) == 1
