"""The HTTP API over a real Redis store, through ASGITransport (and once through the lifespan)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from coalescer import keyset
from coalescer.settings import Settings
from coalescer.store import Store
from coalescer.web.app import create_app
from tests.web.conftest import AUTH, at, ids, post


@pytest.fixture
async def client(settings: Settings, store: Store) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(settings, store)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as c:
        yield c


async def test_the_seed_example_answers_oldest_first(
    client: httpx.AsyncClient, message: Callable[..., Any]
) -> None:
    a, b, c = ids(3)
    await post(client, *(message(t, scheduled=at(i)) for i, t in enumerate((a, b, c))))
    r = await client.get(f"/k?taskId={a}")
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    assert r.json() == {"supersedes": [a, b, c]}


async def test_the_initial_task_is_placed_by_its_own_order_even_when_running(
    client: httpx.AsyncClient, message: Callable[..., Any]
) -> None:
    a, b, c = ids(3)
    await post(client, *(message(t, scheduled=at(i)) for i, t in enumerate((a, b, c))))
    await post(client, message(b, "running", scheduled=at(1)))
    assert (await client.get(f"/k?taskId={b}")).json() == {"supersedes": [a, b, c]}


async def test_an_unknown_task_is_answered_alone(
    client: httpx.AsyncClient, message: Callable[..., Any]
) -> None:
    a, b = ids(2)
    await post(client, message(a))
    assert (await client.get(f"/k?taskId={b}")).json() == {"supersedes": [b]}


async def test_slash_and_dot_paths_name_the_same_key(
    client: httpx.AsyncClient, message: Callable[..., Any]
) -> None:
    a, b = ids(2)
    await post(
        client,
        *(
            message(t, scheduled=at(i), routes=("coalesce.v1.build.linux",))
            for i, t in enumerate((a, b))
        ),
    )
    assert (await client.get(f"/build/linux?taskId={a}")).json() == {"supersedes": [a, b]}
    assert (await client.get(f"/build.linux?taskId={a}")).json() == {"supersedes": [a, b]}


async def test_age_and_size_thresholds(
    client: httpx.AsyncClient, message: Callable[..., Any]
) -> None:
    a, b = ids(2)
    await post(client, *(message(t, scheduled=at(i)) for i, t in enumerate((a, b))))
    assert (await client.get(f"/k?taskId={a}&size=2")).json() == {"supersedes": [a]}
    assert (await client.get(f"/k?taskId={a}&size=1")).json() == {"supersedes": [a, b]}
    # Scheduled in 2030: nothing has waited yet.
    assert (await client.get(f"/k?taskId={a}&age=0")).json() == {"supersedes": [a]}


async def test_the_list_is_capped_keeping_the_newest_and_the_initial_task(
    redis_url: str, store: Store, message: Callable[..., Any]
) -> None:
    settings = Settings.from_environ(
        {"REDIS_URL": redis_url, "COALESCER_INGEST_TOKEN": "s3cret", "COALESCER_MAX_LIST": "3"}
    )
    app = create_app(settings, store)
    tasks = ids(6)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        await post(c, *(message(t, scheduled=at(i)) for i, t in enumerate(tasks)))
        assert (await c.get(f"/k?taskId={tasks[0]}")).json() == {
            "supersedes": [tasks[0], tasks[4], tasks[5]]
        }


@pytest.mark.parametrize(
    "url,fragment",
    [
        ("/k?taskId=nope", "malformed taskId"),
        ("/a..b?taskId=fN1SbArXTPSVFNUvaOlinQ", "malformed coalescing key"),
        ("/" + "x" * 300 + "?taskId=fN1SbArXTPSVFNUvaOlinQ", "longer than"),
        ("/k?taskId=fN1SbArXTPSVFNUvaOlinQ&age=-1", "'age'"),
        ("/k?taskId=fN1SbArXTPSVFNUvaOlinQ&size=x", "'size'"),
    ],
)
async def test_bad_input_is_a_400_with_a_clear_message(
    client: httpx.AsyncClient, url: str, fragment: str
) -> None:
    r = await client.get(url)
    assert r.status_code == 400
    assert fragment in r.json()["error"]


async def test_reserved_paths_are_not_keys(client: httpx.AsyncClient) -> None:
    for path in ("/v1/nope", "/__nope__", "/static/x.css", "/metrics/x"):
        r = await client.get(path + "?taskId=fN1SbArXTPSVFNUvaOlinQ")
        assert r.status_code == 404, path


async def test_key_without_task_id_lists_pending_as_json_or_html(
    client: httpx.AsyncClient, message: Callable[..., Any]
) -> None:
    a, b = ids(2)
    await post(client, *(message(t, scheduled=at(i)) for i, t in enumerate((a, b))))
    doc = (await client.get("/k")).json()
    assert [t["taskId"] for t in doc["pending"]] == [a, b]
    # Instants as the queue writes them; order: the first run's scheduled time in ms.
    assert doc["pending"][1] == {
        "taskId": b,
        "runId": 0,
        "order": 1893456060000,
        "pendingSince": at(1),
        "deadline": "2030-01-02T00:00:00.000Z",
    }
    page = await client.get("/k", headers={"Accept": "text/html"})
    assert page.headers["content-type"].startswith("text/html")
    assert a in page.text and b in page.text


# -- tc-coalesce compatibility ---------------------------------------------------------------


async def test_compat_list_is_newest_first_when_thresholds_are_exceeded(
    client: httpx.AsyncClient, message: Callable[..., Any]
) -> None:
    a, b, c = ids(3)
    past = "2020-01-01T00:0{}:00.000Z"
    await post(client, *(message(t, scheduled=past.format(i)) for i, t in enumerate((a, b, c))))
    assert (await client.get("/v1/list/5/2/k")).json() == {"supersedes": [c, b, a]}
    assert (await client.get("/v1/list/5/3/k")).json() == {"supersedes": []}
    assert (await client.get("/v1/list/999999999/0/k")).json() == {"supersedes": []}
    assert (await client.get("/v1/list/1/2/empty.key")).json() == {"supersedes": []}
    assert (await client.get("/v1/list/k")).json() == {"supersedes": [c, b, a]}


async def test_compat_non_integer_thresholds_are_404(client: httpx.AsyncClient) -> None:
    assert (await client.get("/v1/list/notanumber/1/k")).status_code == 404
    assert (await client.get("/v1/list/1/notanumber/k")).status_code == 404


async def test_compat_keys_stats_and_ping(
    client: httpx.AsyncClient, message: Callable[..., Any]
) -> None:
    assert (await client.get("/v1/list")).json() == {"coalesce.v1.": []}
    a, b = ids(2)
    await post(
        client, message(a, routes=("coalesce.v1.one",)), message(b, routes=("coalesce.v1.two",))
    )
    assert sorted((await client.get("/v1/list")).json()["coalesce.v1."]) == ["one", "two"]
    stats = (await client.get("/v1/stats")).json()
    assert stats["pending_count"] == "2" and stats["coalesced_lists"] == "2"
    assert stats["total_msgs_handled"] == "2" and stats["events_applied"] == "2"
    assert all(isinstance(v, str) for v in stats.values())
    assert stats["index_counted_at"].endswith("Z")  # counted now: a small index
    ping = (await client.get("/v1/ping")).json()
    assert ping["alive"] is True and ping["uptime"] >= 0


async def test_stats_show_every_counter_even_before_any_event(client: httpx.AsyncClient) -> None:
    stats = (await client.get("/v1/stats")).json()
    assert stats == {
        "total_msgs_handled": "0",
        "events_applied": "0",
        "events_stale": "0",
        "events_ignored": "0",
        "events_expired": "0",
        "events_limited": "0",
        "events_invalid": "0",
        "events_dead_lettered": "0",
        "keys": "0",
        "pending_count": "0",
        "coalesced_lists": "0",
        "index_counted_at": stats["index_counted_at"],
    }
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", stats["index_counted_at"])


async def test_stats_say_null_for_the_totals_of_an_index_not_yet_counted(
    client: httpx.AsyncClient, message: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    await post(client, message(ids(1)[0]))
    monkeypatch.setattr(keyset, "COUNT_INLINE", 0)  # a "large" index: counted by upkeep only
    stats = (await client.get("/v1/stats")).json()
    assert (stats["keys"], stats["events_applied"]) == ("1", "1")
    assert stats["pending_count"] is None and stats["coalesced_lists"] is None
    assert stats["index_counted_at"] is None


# -- ingest -----------------------------------------------------------------------------------


async def test_ingest_reports_per_message_outcomes(
    client: httpx.AsyncClient, message: Callable[..., Any]
) -> None:
    a, b = ids(2)
    bad = message(b)
    del bad["payload"]["status"]
    results = await post(
        client, message(a), message(a), message(a, routes=("other.route",)), bad, {"nope": 1}
    )
    assert [r["status"] for r in results] == ["applied", "stale", "ignored", "invalid", "invalid"]
    assert "status" in results[3]["error"]


async def test_the_queues_other_exchanges_are_ignored_and_unknown_ones_invalid(
    client: httpx.AsyncClient, message: Callable[..., Any]
) -> None:
    """What a queue (or the emulator's --publish-to) sends besides task states has nothing for
    the index; a name the queue never publishes on is a mistake."""
    (a,) = ids(1)
    others = [
        {**message(a), "exchange": f"exchange/taskcluster-queue/v1/{name}"}
        for name in ("task-defined", "artifact-created", "task-group-resolved")
    ]
    unknown = {**message(a), "exchange": "exchange/taskcluster-queue/v1/task-exploded"}
    results = await post(client, *others, unknown)
    assert [r["status"] for r in results] == ["ignored", "ignored", "ignored", "invalid"]
    assert "task-exploded" in results[3]["error"]


async def test_ingest_accepts_one_message_and_the_routes_spelling(
    client: httpx.AsyncClient, message: Callable[..., Any]
) -> None:
    (a,) = ids(1)
    doc = message(a)
    doc["routes"] = [r.removeprefix("route.") for r in doc.pop("CC")]
    r = await client.post("/v1/events", json=doc, headers=AUTH)
    assert r.json()["results"] == [{"status": "applied", "taskId": a}]


async def test_ingest_exception_without_run_id_resolves_the_task(
    client: httpx.AsyncClient, message: Callable[..., Any]
) -> None:
    (a,) = ids(1)
    await post(client, message(a))
    assert (await post(client, message(a, "exception", run_id=None, runs=[])))[0][
        "status"
    ] == "applied"
    assert (await client.get("/k")).json()["pending"] == []


async def test_ingest_needs_the_right_token(
    settings: Settings, store: Store, redis_url: str
) -> None:
    app = create_app(settings, store)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        assert (await c.post("/v1/events", json=[])).status_code == 401
        assert (
            await c.post("/v1/events", json=[], headers={"Authorization": "Bearer wrong"})
        ).status_code == 401
    off = create_app(Settings.from_environ({"REDIS_URL": redis_url}), store)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(off), base_url="http://t") as c:
        r = await c.post("/v1/events", json=[], headers=AUTH)
        assert r.status_code == 403 and "COALESCER_INGEST_TOKEN" in r.json()["error"]


async def test_ingest_refuses_bad_json_and_oversized_bodies(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/events", content=b"{not json", headers=AUTH)
    assert r.status_code == 400 and "not JSON" in r.json()["error"]
    r = await client.post("/v1/events", content=b"[" + b" " * (2 << 20) + b"]", headers=AUTH)
    assert r.status_code == 413


# -- operations -------------------------------------------------------------------------------


async def test_dockerflow_endpoints(client: httpx.AsyncClient) -> None:
    beat = (await client.get("/__heartbeat__")).json()
    assert beat["status"] == "ok"
    assert beat["checks"] == {
        "redis": "ok",
        "writable": "ok",
        "eviction": "ok",
        "limits": "ok",
        "index": "unknown",  # nothing watches the store without the lifespan
        "background": "ok",
    }
    assert (await client.get("/__lbheartbeat__")).status_code == 200
    assert (await client.get("/__version__")).json()["name"] == "coalescer"


async def test_redis_down_is_a_503_with_a_clear_body(settings: Settings) -> None:
    from coalescer.store import open_store

    dead = await open_store("redis://127.0.0.1:1/0", grace_seconds=60)
    app = create_app(settings, dead)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        r = await c.get("/k?taskId=fN1SbArXTPSVFNUvaOlinQ")
        assert r.status_code == 503 and "unavailable" in r.json()["error"]
        assert (await c.get("/__heartbeat__")).status_code == 503
    await dead.close()


async def test_the_real_lifespan_opens_and_closes_the_store(
    redis_client: Any, redis_url: str
) -> None:
    app = create_app(Settings.from_environ({"REDIS_URL": redis_url}))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
            assert (await c.get("/__heartbeat__")).json()["store"] == "redis"
