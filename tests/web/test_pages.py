"""The browser pages and their JSON twins: the keys, a key, a task."""

from __future__ import annotations

import re

import httpx
from starlette.applications import Starlette

from tests.conftest import make_message
from tests.web.conftest import HTML, at, ids, post, supersede_scenario


async def test_overview_lists_keys_with_pending_count_and_oldest_wait(
    client: httpx.AsyncClient,
) -> None:
    a, b, c = ids(3)
    await post(
        client,
        make_message(a, scheduled=at(0), routes=("coalesce.v1.gecko.linux",)),
        make_message(b, scheduled=at(1), routes=("coalesce.v1.gecko.linux",)),
        make_message(c, scheduled=at(2), routes=("coalesce.v1.gecko.mac",)),
    )
    await post(
        client, make_message(c, "running", scheduled=at(2), routes=("coalesce.v1.gecko.mac",))
    )
    doc = (await client.get("/")).json()
    rows = {row["key"]: row for row in doc["keys"]}
    assert doc["total"] == 2
    assert rows["gecko.linux"]["pending"] == 2
    assert rows["gecko.linux"]["oldestPendingSince"] == at(0)
    assert rows["gecko.mac"]["pending"] == 0
    assert rows["gecko.mac"]["oldestPendingSince"] is None
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", rows["gecko.mac"]["lastActivity"]
    )

    page = await client.get("/", headers=HTML)
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert '<meta http-equiv="refresh"' in page.text
    assert 'href="/gecko.linux"' in page.text and 'href="/gecko.mac"' in page.text
    assert "<script" not in page.text


async def test_overview_filters_by_substring_or_glob(client: httpx.AsyncClient) -> None:
    keys = ("gecko.linux.opt", "gecko.mac.opt", "try.linux.debug")
    await post(
        client,
        *(make_message(t, routes=(f"coalesce.v1.{k}",)) for t, k in zip(ids(3), keys, strict=True)),
    )

    async def found(q: str) -> list[str]:
        r = await client.get("/", params={"q": q})
        assert r.status_code == 200
        return sorted(row["key"] for row in r.json()["keys"])

    assert await found("linux") == ["gecko.linux.opt", "try.linux.debug"]
    assert await found("LINUX.OPT") == ["gecko.linux.opt"]
    assert await found("gecko.*.opt") == ["gecko.linux.opt", "gecko.mac.opt"]
    assert await found("nothing") == []
    page = await client.get("/?q=nothing", headers=HTML)
    assert "No key matches" in page.text


async def test_key_page_shows_pending_answers_and_superseded_resolutions(
    client: httpx.AsyncClient, app: Starlette
) -> None:
    a, b, c, d = await supersede_scenario(client, app)
    page = (await client.get("/k", headers=HTML)).text
    pending = page.split("<h2>Pending tasks</h2>")[1].split("<h2>")[0]
    assert d in pending and a not in pending and c not in pending
    answers = page.split("<h2>Recent answers</h2>")[1].split("<h2>")[0]
    assert f'href="/tasks/{b}?key=k"' in answers and "3 tasks" in answers
    resolutions = page.split("<h2>Recent resolutions</h2>")[1]
    assert resolutions.count('class="pill superseded">superseded') == 2
    assert a in resolutions and b in resolutions and "completed" in resolutions


async def test_key_page_links_to_taskcluster_when_a_root_url_is_set(
    client: httpx.AsyncClient, app: Starlette
) -> None:
    import dataclasses

    (a,) = ids(1)
    await post(client, make_message(a))
    page = (await client.get("/k", headers=HTML)).text
    assert "/tasks/" + a in page and "Taskcluster ↗" not in page
    app.state.settings = dataclasses.replace(
        app.state.settings, taskcluster_root_url="https://tc.example.com"
    )
    page = (await client.get("/k", headers=HTML)).text
    assert f'href="https://tc.example.com/tasks/{a}"' in page


async def test_task_page_says_who_superseded_a_task(
    client: httpx.AsyncClient, app: Starlette
) -> None:
    a, b, c, _ = await supersede_scenario(client, app)
    doc = (await client.get(f"/tasks/{a}")).json()
    (under,) = doc["keys"]
    assert under["key"] == "k"
    assert (under["state"], under["reason"]) == ("exception", "superseded")
    assert under["supersededBy"] == c
    assert under["listing"]["initial"] == b and under["listing"]["count"] == 3
    assert under["newestState"] == "completed"
    assert under["deadline"] == "2030-01-02T00:00:00.000Z" and under["pendingSince"] == at(0)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", under["listing"]["at"])

    page = (await client.get(f"/tasks/{a}", headers=HTML)).text
    assert "<b>Superseded</b>, most likely by" in page
    assert re.search(rf'href="/tasks/{c}\?key=k"', page)


async def test_task_page_says_what_the_primary_superseded(
    client: httpx.AsyncClient, app: Starlette
) -> None:
    a, b, c, _ = await supersede_scenario(client, app)
    doc = (await client.get(f"/tasks/{c}")).json()
    (under,) = doc["keys"]
    assert under["state"] == "completed" and under["supersededBy"] is None
    assert under["supersedes"] == [
        {"taskId": a, "state": "exception", "reason": "superseded"},
        {"taskId": b, "state": "exception", "reason": "superseded"},
    ]
    page = (await client.get(f"/tasks/{c}", headers=HTML)).text
    assert "likely primary" in page and page.count("superseded</span>") >= 2


async def test_task_page_of_a_task_answered_alone(
    client: httpx.AsyncClient, app: Starlette
) -> None:
    a, other = ids(2)
    await post(client, make_message(other))
    await client.get(f"/k?taskId={a}")  # not seen yet: answered alone
    await app.state.observer.flush()
    doc = (await client.get(f"/tasks/{a}")).json()
    (under,) = doc["keys"]
    assert under["known"] is False
    assert under["listing"]["reason"] == "unknown" and under["listing"]["count"] == 1
    page = (await client.get(f"/tasks/{a}", headers=HTML)).text
    assert "had not seen the task yet" in page


async def test_task_page_errors_are_clear(client: httpx.AsyncClient) -> None:
    (a,) = ids(1)
    r = await client.get(f"/tasks/{a}")
    assert r.status_code == 404 and "knows nothing of task" in r.json()["error"]
    page = await client.get(f"/tasks/{a}", headers=HTML)
    assert page.status_code == 404 and "knows nothing of task" in page.text
    r = await client.get("/tasks/nope")
    assert r.status_code == 400 and "malformed taskId" in r.json()["error"]
    page = await client.get("/tasks/nope", headers=HTML)
    assert page.status_code == 400 and page.headers["content-type"].startswith("text/html")


async def test_a_browser_gets_error_pages_not_json(client: httpx.AsyncClient) -> None:
    page = await client.get("/k?taskId=nope", headers=HTML)
    assert page.status_code == 400 and "<h1>400</h1>" in page.text
    assert (await client.get("/k?taskId=nope")).json()["status"] == 400
