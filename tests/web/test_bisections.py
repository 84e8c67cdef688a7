"""Bisection findings: ``POST /v1/bisections`` (a worker's report), the ``bisection`` field of
``GET /v1/tasks/<taskId>``, the task and key pages, and the metrics."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import httpx
import jsonschema
import pytest
from prometheus_client import REGISTRY
from starlette.applications import Starlette

from coalescer import observe
from coalescer.settings import Settings
from coalescer.store import Store
from coalescer.web.app import create_app
from coalescer.web.openapi import document
from tests.conftest import make_message
from tests.web.conftest import AUTH, HTML, at, ids, post

CULPRITS = "coalescer_culprits_located_total"
EXTRA_RUNS = "coalescer_bisection_extra_runs_total"


def sample(name: str, source: str) -> float:
    return REGISTRY.get_sample_value(name, {"source": source}) or 0.0


def ref(task_id: str, run_id: int = 0) -> dict[str, Any]:
    return {"taskId": task_id, "runId": run_id}


def finding(pushes: list[str], key: str = "k") -> dict[str, Any]:
    """Pushes 1..6, push 6 the failed primary: push 4 is the culprit, push 3 the last good
    (its first run failed, its confirmation passed: intermittent), push 5 ran and failed, and
    pushes 1 and 2 did not run: push 3's pass stands for them."""
    p1, p2, p3, p4, p5, p6 = pushes
    return {
        "key": key,
        "by": "worker g/w1",
        "primary": ref(p6),
        "held": 5,
        "culprit": ref(p4),
        "lastGood": ref(p3),
        "runs": [
            {**ref(p6), "attempt": 0, "passed": False, "ended": "2026-01-01T01:00:00.000Z"},
            {**ref(p3), "attempt": 0, "passed": False, "ended": "2026-01-01T01:10:00.000Z"},
            {**ref(p3), "attempt": 1, "passed": True, "ended": "2026-01-01T01:20:00.000Z"},
            {**ref(p5), "attempt": 0, "passed": False, "ended": "2026-01-01T01:30:00.000Z"},
            {**ref(p4), "attempt": 0, "passed": False, "ended": "2026-01-01T01:40:00.000Z"},
        ],
        "intermittent": [ref(p3)],
        "standsFor": [{**ref(p1), "by": ref(p3)}, {**ref(p2), "by": ref(p3)}],
        "extraRuns": 4,
        "located": "2026-01-01T01:41:00.000Z",
    }


async def pushes(client: httpx.AsyncClient, key: str = "k") -> list[str]:
    """Six tasks of ``key``, known to the index."""
    tasks = ids(6)
    route = (f"coalesce.v1.{key}",)
    await post(
        client, *(make_message(t, scheduled=at(i), routes=route) for i, t in enumerate(tasks))
    )
    return tasks


async def report(client: httpx.AsyncClient, doc: Any, **headers: str) -> httpx.Response:
    return await client.post("/v1/bisections", json=doc, headers={**AUTH, **headers})


# -- POST /v1/bisections ------------------------------------------------------------------------


async def test_a_report_needs_the_ingest_token(
    client: httpx.AsyncClient, settings: Settings, store: Store
) -> None:
    doc = finding(ids(6))
    r = await client.post("/v1/bisections", json=doc)
    assert r.status_code == 401 and "bearer token" in r.json()["error"]
    r = await client.post("/v1/bisections", json=doc, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401
    disabled = create_app(dataclasses.replace(settings, ingest_token=None), store)
    transport = httpx.ASGITransport(disabled)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as other:
        r = await report(other, doc)
    assert r.status_code == 403 and "COALESCER_INGEST_TOKEN" in r.json()["error"]
    assert (await client.get(f"/v1/tasks/{doc['culprit']['taskId']}")).status_code == 404


def _broken(doc: dict[str, Any], change: str) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    if change == "missing key":
        del doc["key"]
    elif change == "tasks given":
        doc["tasks"] = [doc["primary"]["taskId"]]
    elif change == "bad run taskId":
        doc["runs"][2]["taskId"] = "not-a-slugid"
    elif change == "taskId with a newline":
        doc["standsFor"][1]["by"]["taskId"] += "\n"
    elif change == "too many runs":
        doc["runs"] = doc["runs"] * 13
    elif change == "bad key":
        doc["key"] = "a..b"
    elif change == "bad time":
        doc["located"] = "2030-13-45T00:00:00.000Z"
    elif change == "negative runId":
        doc["culprit"]["runId"] = -1
    elif change == "passed not a boolean":
        doc["runs"][0]["passed"] = "no"
    elif change == "culprit not among the runs":
        doc["culprit"] = doc["standsFor"][0]["by"] | {"taskId": doc["standsFor"][0]["taskId"]}
    elif change == "culprit that passed":
        doc["culprit"] = {"taskId": doc["lastGood"]["taskId"], "runId": 0}
        doc["runs"] = [
            r for r in doc["runs"] if r["passed"] or r["taskId"] != doc["culprit"]["taskId"]
        ]
    elif change == "primary not among the runs":
        doc["runs"] = doc["runs"][1:]
    elif change == "runId 1.0":
        doc["runs"][1]["runId"] = 1.0
        doc["culprit"]["runId"] = 1.0
    elif change == "held 5.0":
        doc["held"] = 5.0
    elif change == "located in year 9999":
        doc["located"] = "9999-12-31T00:00:00.000Z"
    elif change == "ended far in the future":
        doc["runs"][3]["ended"] = "2099-01-01T00:00:00.000Z"
    elif change == "located before 2000":
        doc["located"] = "1970-01-01T00:00:00.000Z"
    return doc


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ("missing key", "'key' is a required property"),
        ("tasks given", "'tasks' was unexpected"),
        ("bad run taskId", "runs/2/taskId"),
        ("taskId with a newline", "standsFor/1/by: malformed taskId"),
        ("too many runs", "runs: "),
        ("bad key", "key: 'a..b' does not match"),
        ("bad time", "located: not an RFC 3339 date-time"),
        ("negative runId", "culprit/runId"),
        ("passed not a boolean", "runs/0/passed"),
        ("culprit not among the runs", "culprit: not among the runs"),
        ("culprit that passed", "culprit: every run of it passed"),
        ("primary not among the runs", "primary: not among the runs"),
        ("runId 1.0", "/runId: must be an integer, not 1.0"),
        ("held 5.0", "held: must be an integer, not 5.0"),
        ("located in year 9999", "located: 9999-12-31T00:00:00.000Z is more than a day ahead"),
        ("ended far in the future", "runs/3/ended: 2099-01-01T00:00:00.000Z is more than a day"),
        ("located before 2000", "located: 1970-01-01T00:00:00.000Z is before 2000"),
    ],
)
async def test_a_malformed_finding_is_a_400_saying_what_is_wrong(
    client: httpx.AsyncClient, change: str, says: str
) -> None:
    tasks = ids(6)
    r = await report(client, _broken(finding(tasks), change))
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]
    assert (await client.get(f"/v1/tasks/{tasks[3]}")).status_code == 404


async def test_bodies_that_are_not_a_finding_are_refused(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/bisections", content=b"{", headers=AUTH)
    assert r.status_code == 400 and "not JSON" in r.json()["error"]
    r = await client.post("/v1/bisections", content=b"[]", headers=AUTH)
    assert r.status_code == 400 and "not a bisection finding" in r.json()["error"]
    big = finding(ids(6))
    big["by"] = "x" * 70_000
    r = await report(client, big)
    assert r.status_code == 413 and "larger than" in r.json()["error"]


async def test_a_finding_is_recorded_and_counted_once(client: httpx.AsyncClient) -> None:
    tasks = await pushes(client)
    culprits, extra = sample(CULPRITS, "http"), sample(EXTRA_RUNS, "http")
    r = await report(client, finding(tasks))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["new"] is True
    named = [tasks[i] for i in (5, 3, 2, 4, 0, 1)]
    assert body["finding"] == {**finding(tasks), "tasks": named}
    assert sample(CULPRITS, "http") == culprits + 1
    assert sample(EXTRA_RUNS, "http") == extra + 4
    # A retry of the same finding changes nothing, and is not counted again.
    again = await report(client, finding(tasks))
    assert again.status_code == 200 and again.json()["new"] is False
    assert sample(CULPRITS, "http") == culprits + 1
    assert sample(EXTRA_RUNS, "http") == extra + 4
    text = (await client.get("/metrics")).text
    assert f'{CULPRITS}{{source="http"}}' in text and f'{EXTRA_RUNS}{{source="http"}}' in text


async def test_a_finding_without_a_culprit_counts_its_runs_only(client: httpx.AsyncClient) -> None:
    tasks = await pushes(client)
    doc = finding(tasks)
    doc |= {"culprit": None, "lastGood": None, "runs": doc["runs"][:1], "extraRuns": 1}
    doc |= {"intermittent": [ref(tasks[5])], "standsFor": []}
    culprits, extra = sample(CULPRITS, "http"), sample(EXTRA_RUNS, "http")
    assert (await report(client, doc)).status_code == 200
    assert sample(CULPRITS, "http") == culprits
    assert sample(EXTRA_RUNS, "http") == extra + 1


def test_the_enforcer_counts_its_findings_the_same_way() -> None:
    culprits, extra = sample(CULPRITS, "enforcer"), sample(EXTRA_RUNS, "enforcer")
    observe.bisection_recorded(finding(ids(6)))
    assert sample(CULPRITS, "enforcer") == culprits + 1
    assert sample(EXTRA_RUNS, "enforcer") == extra + 4


# -- GET /v1/tasks/<taskId> ---------------------------------------------------------------------


async def test_every_task_a_finding_names_gets_it_with_its_role(client: httpx.AsyncClient) -> None:
    tasks = await pushes(client)
    (other,) = ids(1)
    assert (await report(client, finding(tasks))).status_code == 200
    lineage = document()["components"]["schemas"]["Lineage"]
    checker = jsonschema.Draft202012Validator({**lineage, "components": document()["components"]})
    roles = ["stoodFor", "stoodFor", "lastGood", "culprit", "ran", "primary"]
    for task_id, role in zip(tasks, roles, strict=True):
        r = await client.get(f"/v1/tasks/{task_id}")
        assert r.status_code == 200, r.text
        body = r.json()
        checker.validate(body)
        [found] = body["bisection"]
        assert found["role"] == role, task_id
        assert found["culprit"] == ref(tasks[3]) and found["lastGood"] == ref(tasks[2])
        assert [(x["taskId"], x["attempt"], x["passed"]) for x in found["runs"]] == [
            (tasks[5], 0, False),
            (tasks[2], 0, False),
            (tasks[2], 1, True),
            (tasks[4], 0, False),
            (tasks[3], 0, False),
        ]
        assert found["runs"][-1]["ended"] == "2026-01-01T01:40:00.000Z"
        assert body["supersededBy"] is None and body["chain"] == []
    r = await client.get(f"/v1/tasks/{other}")
    assert r.status_code == 404 and "bisection" in r.json()["error"]


async def test_a_task_no_finding_names_is_still_a_404(client: httpx.AsyncClient) -> None:
    tasks = await pushes(client)
    await report(client, finding(tasks))
    (stranger,) = ids(1)
    await post(client, make_message(stranger, scheduled=at(9)))
    r = await client.get(f"/v1/tasks/{stranger}")
    assert r.status_code == 404


# -- pages --------------------------------------------------------------------------------------


async def test_the_culprits_page_names_it_and_every_run(
    client: httpx.AsyncClient, app: Starlette
) -> None:
    tasks = await pushes(client)
    doc = finding(tasks)
    doc["by"] = "worker <b>g</b>/w1"
    assert (await report(client, doc)).status_code == 200
    page = (await client.get(f"/tasks/{tasks[3]}", headers=HTML)).text
    assert "Bisection under key" in page
    assert "This task is the <b>culprit</b>" in page
    assert f'href="/tasks/{tasks[5]}?key=k"' in page  # the primary
    for run in doc["runs"]:
        assert run["ended"] in page
    assert page.count('<span class="pill failed">failed</span>') == 4
    assert page.count('<span class="pill completed">passed</span>') == 1
    assert "(confirmation)" in page and "Intermittent" in page
    assert "worker &lt;b&gt;g&lt;/b&gt;/w1" in page and "<b>g</b>" not in page
    assert "Taskcluster ↗" not in page
    primary = (await client.get(f"/tasks/{tasks[5]}", headers=HTML)).text
    assert "was the newest of its key and <b>failed</b>" in primary
    stood = (await client.get(f"/tasks/{tasks[0]}", headers=HTML)).text
    assert "This task did not run" in stood
    app.state.settings = dataclasses.replace(
        app.state.settings, taskcluster_root_url="https://tc.example.com"
    )
    page = (await client.get(f"/tasks/{tasks[3]}", headers=HTML)).text
    assert f'href="https://tc.example.com/tasks/{tasks[2]}"' in page  # the last good


async def test_the_key_page_lists_its_recent_findings(client: httpx.AsyncClient) -> None:
    tasks = await pushes(client)
    page = (await client.get("/k", headers=HTML)).text
    assert "No bisection recorded for this key." in page
    assert (await report(client, finding(tasks))).status_code == 200
    page = (await client.get("/k", headers=HTML)).text
    section = page[page.index("Recent bisections") : page.index("Recent resolutions")]
    assert f"/tasks/{tasks[3]}?key=k" in section and f"/tasks/{tasks[5]}?key=k" in section
    assert "worker g/w1" in section


async def test_a_flood_of_findings_stops_at_coalescer_max_findings(
    settings: Settings, store: Store, redis_client: Any
) -> None:
    """3,000 findings on 3,000 new keys: the first COALESCER_MAX_FINDINGS are recorded, the
    rest refused (507) and counted, and Redis holds no more."""
    limit, flood = 100, 3000
    app = create_app(dataclasses.replace(settings, max_findings=limit), store)
    refused_before = REGISTRY.get_sample_value("coalescer_findings_limited_total") or 0.0
    statuses: dict[int, int] = {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://x") as c:
        first = finding(ids(6), key="flood.0")
        for n in range(flood):
            doc = first if n == 0 else finding(ids(6), key=f"flood.{n}")
            r = await report(c, doc)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if r.status_code == 507:
                assert "COALESCER_MAX_FINDINGS=100" in r.json()["error"], r.text
        # A finding kept already may be reported again (a retry), at the limit too.
        assert (await report(c, first)).status_code == 200
    assert statuses == {200: limit, 507: flood - limit}
    refused = REGISTRY.get_sample_value("coalescer_findings_limited_total") or 0.0
    assert refused - refused_before == flood - limit
    held = [k async for k in redis_client.scan_iter(match="co:{flood.*}:b")]
    assert len(held) == limit


# -- GET /v1/bisections -------------------------------------------------------------------------


def _located(doc: dict[str, Any], minute: int) -> dict[str, Any]:
    doc["located"] = f"2026-01-01T02:{minute:02d}:00.000Z"
    return doc


async def test_a_keys_findings_are_listed_newest_first_a_page_at_a_time(
    client: httpx.AsyncClient,
) -> None:
    # Seven findings, two of them located at the same instant; one of another key.
    docs = [_located(finding(ids(6), key="pages"), m) for m in (1, 2, 3, 3, 4, 5, 6)]
    for doc in docs:
        assert (await report(client, doc)).status_code == 200, doc
    assert (await report(client, finding(ids(6), key="other"))).status_code == 200
    newest_first = sorted(docs, key=lambda d: (d["located"], d["primary"]["taskId"]), reverse=True)
    seen: list[str] = []
    token: str | None = None
    pages = 0
    while True:
        params = {"key": "pages", "limit": "3"} | ({"continuationToken": token} if token else {})
        r = await client.get("/v1/bisections", params=params)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["key"] == "pages" and len(body["findings"]) <= 3
        seen += [f["primary"]["taskId"] for f in body["findings"]]
        pages += 1
        if pages == 1:
            # A finding recorded meanwhile (newer) shifts nothing: the token is a place.
            late = _located(finding(ids(6), key="pages"), 59)
            assert (await report(client, late)).status_code == 200
        token = body.get("continuationToken")
        if token is None:
            break
    assert seen == [d["primary"]["taskId"] for d in newest_first]
    assert pages == 3
    first = (await client.get("/v1/bisections", params={"key": "pages"})).json()
    assert first["findings"][0]["primary"] == late["primary"]
    assert first["findings"][1] == {**newest_first[0], "tasks": first["findings"][1]["tasks"]}
    assert "continuationToken" not in first  # 8 findings: one page at the default size


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ({}, "missing coalescing key"),
        ({"key": "a..b"}, "a..b"),
        ({"key": "k", "limit": "0"}, "'limit' must be a whole number from 1 to 200"),
        ({"key": "k", "limit": "201"}, "'limit'"),
        ({"key": "k", "limit": "²"}, "'limit'"),
        ({"key": "k", "limit": ""}, "'limit'"),  # the fuzzing's find
        ({"key": "k", "continuationToken": "nope"}, "'continuationToken'"),
        ({"key": "k", "continuationToken": ""}, "'continuationToken'"),  # the fuzzing's find
    ],
)
async def test_a_bad_listing_request_is_a_400(
    client: httpx.AsyncClient, params: dict[str, str], says: str
) -> None:
    r = await client.get("/v1/bisections", params=params)
    assert r.status_code == 400 and says in r.json()["error"], r.text


async def test_a_key_without_findings_lists_none(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/bisections", params={"key": "nothing.here"})
    assert r.status_code == 200 and r.json() == {"key": "nothing.here", "findings": []}


async def test_the_gap_lists_what_the_index_knows_between_two_tasks_of_a_key(
    client: httpx.AsyncClient,
) -> None:
    """What a worker's search asks before it names a culprit: every task of the key between
    the last good and the first failing task it held, whatever its state, oldest first."""
    t = ids(6)
    states = ["completed", "failed", "running", "pending", "pending"]
    await post(
        client,
        *(make_message(t[i], s, scheduled=at(i + 1)) for i, s in enumerate(states)),
        make_message(t[5], "failed", scheduled=at(3), routes=("coalesce.v1.other",)),
    )
    r = await client.get("/v1/bisections/gap", params={"key": "k", "after": t[0], "before": t[4]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["key"] == "k"
    assert [(x["taskId"], x["state"]) for x in body["tasks"]] == list(
        zip(t[1:4], states[1:4], strict=True)
    )
    orders = [x["order"] for x in body["tasks"]]
    assert orders == sorted(orders) and all(x["runId"] == 0 for x in body["tasks"])
    below = (await client.get("/v1/bisections/gap", params={"key": "k", "before": t[2]})).json()
    assert [x["taskId"] for x in below["tasks"]] == t[:2]
    answer = document()["paths"]["/v1/bisections/gap"]["get"]["responses"]["200"]["content"]
    assert answer["application/json"]["schema"] == {"$ref": "#/components/schemas/BisectionGap"}
    jsonschema.validate(body, document()["components"]["schemas"]["BisectionGap"])


@pytest.mark.parametrize(
    ("params", "status", "says"),
    [
        ({"before": "x"}, 400, "missing coalescing key"),
        ({"key": "k"}, 400, "task"),
        ({"key": "k", "before": "not-a-slug"}, 400, "not-a-slug"),
        ({"key": "k", "before": "fN1SbArXTPSVFNUvaOlinQ"}, 404, "knows no task"),
    ],
)
async def test_a_gap_of_unknown_or_malformed_tasks_says_why(
    client: httpx.AsyncClient, params: dict[str, str], status: int, says: str
) -> None:
    r = await client.get("/v1/bisections/gap", params=params)
    assert r.status_code == status and says in r.json()["error"], r.text
