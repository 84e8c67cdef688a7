"""``GET /v1/docker-worker[/<age>/<size>]/<key>?taskId=``: the answer an unmodified docker-worker
follows (newest first, its own task included while pending or running), over real Redis."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from coalescer.settings import Settings
from coalescer.store import Store
from coalescer.web.app import create_app
from tests.web.conftest import at, ids, post

PAST = "2020-01-01T00:0{}:00.000Z"


async def test_newest_first_with_the_running_initial_task_in_its_place(
    client: httpx.AsyncClient, message: Callable[..., Any]
) -> None:
    a, b, c, d = ids(4)
    await post(client, *(message(t, scheduled=at(i)) for i, t in enumerate((a, b, c, d))))
    await post(client, message(b, "running", scheduled=at(1)))
    r = await client.get(f"/v1/docker-worker/k?taskId={b}")
    assert r.status_code == 200
    assert r.json() == {"supersedes": [d, c, b, a]}
    # The native route is the same list the other way round.
    assert (await client.get(f"/k?taskId={b}")).json() == {"supersedes": [a, b, c, d]}


async def test_an_unknown_or_resolved_initial_task_is_answered_alone(
    client: httpx.AsyncClient, message: Callable[..., Any]
) -> None:
    a, b, c = ids(3)
    await post(client, *(message(t, scheduled=at(i)) for i, t in enumerate((a, b))))
    assert (await client.get(f"/v1/docker-worker/k?taskId={c}")).json() == {"supersedes": [c]}
    await post(client, message(c, scheduled=at(2)))
    await post(client, message(c, "exception", scheduled=at(2), reason="canceled"))
    assert (await client.get(f"/v1/docker-worker/k?taskId={c}")).json() == {"supersedes": [c]}
    # A retry the index has seen is pending again, and supersedes as before.
    await post(client, message(c, run_id=1, scheduled=at(2)))
    assert (await client.get(f"/v1/docker-worker/k?taskId={c}")).json() == {"supersedes": [c, b, a]}


async def test_thresholds_answer_the_initial_task_alone_until_exceeded(
    client: httpx.AsyncClient, message: Callable[..., Any]
) -> None:
    a, b, c = ids(3)
    await post(client, *(message(t, scheduled=PAST.format(i)) for i, t in enumerate((a, b, c))))
    assert (await client.get(f"/v1/docker-worker/5/2/k?taskId={a}")).json() == {
        "supersedes": [c, b, a]
    }
    assert (await client.get(f"/v1/docker-worker/5/3/k?taskId={a}")).json() == {"supersedes": [a]}
    assert (await client.get(f"/v1/docker-worker/999999999/0/k?taskId={a}")).json() == {
        "supersedes": [a]
    }


async def test_the_cap_keeps_the_newest_and_the_initial_task(
    redis_url: str, store: Store, message: Callable[..., Any]
) -> None:
    settings = Settings.from_environ(
        {"REDIS_URL": redis_url, "COALESCER_INGEST_TOKEN": "s3cret", "COALESCER_MAX_LIST": "3"}
    )
    tasks = ids(6)
    app = create_app(settings, store)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        await post(c, *(message(t, scheduled=at(i)) for i, t in enumerate(tasks)))
        assert (await c.get(f"/v1/docker-worker/k?taskId={tasks[0]}")).json() == {
            "supersedes": [tasks[5], tasks[4], tasks[0]]
        }


@pytest.mark.parametrize(
    "url,status,fragment",
    [
        ("/v1/docker-worker/k", 400, "missing query parameter 'taskId'"),
        # A supersederUrl with a query string: docker-worker appends "?taskId=" blindly.
        ("/v1/docker-worker/k?size=2?taskId=fN1SbArXTPSVFNUvaOlinQ", 400, "no query string"),
        ("/v1/docker-worker/k?taskId=nope", 400, "malformed taskId"),
        ("/v1/docker-worker/a..b?taskId=fN1SbArXTPSVFNUvaOlinQ", 400, "malformed coalescing key"),
        ("/v1/docker-worker/build/linux?taskId=fN1SbArXTPSVFNUvaOlinQ", 404, "no such endpoint"),
        ("/v1/docker-worker/x/2/k?taskId=fN1SbArXTPSVFNUvaOlinQ", 404, "no such endpoint"),
    ],
)
async def test_bad_input_is_refused_with_a_clear_message(
    client: httpx.AsyncClient, url: str, status: int, fragment: str
) -> None:
    r = await client.get(url)
    assert r.status_code == status
    assert fragment in r.json()["error"]
