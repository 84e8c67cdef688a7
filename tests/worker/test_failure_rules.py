"""Superseding never blocks work: each way the superseder can fail runs the claimed task alone,
and a malicious superseder cannot make a worker claim foreign tasks."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
from collections.abc import Sequence

import orjson
import pytest
from starlette.responses import Response

from coalescer.emulator.harness import QueueEmulator
from coalescer.worker import Claim, Options, Outcome, Shim, Superseded
from coalescer.worker.protocol import COMPLETED
from tests.worker.support import Superseder, Tasks, claim_work, make_shim


async def ran_alone(claim: Claim, supersedes: Sequence[Superseded]) -> Outcome:
    assert supersedes == []
    return COMPLETED


def json_answer(body: object) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")


async def slow(key: str, task_id: str) -> Response:
    await asyncio.sleep(1.5)
    return json_answer({"supersedes": [task_id]})


async def not_json(key: str, task_id: str) -> Response:
    return Response("<html>busy</html>", media_type="text/html")


async def server_error(key: str, task_id: str) -> Response:
    return Response("oops", status_code=500)


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("no-url", "no-url"),
        ("not-allowed", "not-allowed"),
        ("down", "unavailable"),
        ("slow", "timeout"),
        ("not-json", "not-json"),
        ("http-500", "bad-status"),
        ("initial-missing", "initial-missing"),
        ("empty", "empty"),
    ],
)
async def test_a_useless_superseder_leaves_the_claimed_task_to_run_alone(
    case: str,
    reason: str,
    queue_emulator: QueueEmulator,
    options: Options,
    tasks: Tasks,
    superseder: Superseder,
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = {
        "no-url": "",
        "not-allowed": "http://elsewhere.invalid/k",
        "down": closed_port_url() + "/k",
    }.get(case)
    initial = tasks.create(url=url)
    newer = tasks.create()
    superseder.answer = {"slow": slow, "not-json": not_json, "http-500": server_error}.get(case)
    superseder.lists["k"] = {"initial-missing": [newer], "empty": []}.get(case, [initial, newer])
    if url is not None and case == "down":
        options = dataclasses.replace(options, allow=(*options.allow, url))
    options = dataclasses.replace(options, timeout=0.5)

    caplog.set_level(logging.INFO, "coalescer.worker")
    async with make_shim(queue_emulator, options) as shim:
        [work] = await claim_work(shim)
        report = await shim.run(work, ran_alone)

    assert report.alone == reason
    assert report.primary == (initial, 0) and report.superseded == []
    assert tasks.last_run(initial)["state"] == "completed"
    assert tasks.status(newer)["state"] == "pending"
    assert any("alone" in r.getMessage() for r in caplog.records)
    if case in ("no-url", "not-allowed"):
        assert superseder.asked == []  # never followed


async def test_a_malicious_superseder_cannot_make_the_worker_claim_foreign_tasks(
    shim: Shim, tasks: Tasks, superseder: Superseder, queue_emulator: QueueEmulator
) -> None:
    initial = tasks.create()
    foreign = [
        tasks.create(queue="emulator-test/other"),  # same key, another task queue
        tasks.create("other-key"),  # same queue, another key
        tasks.create(routes=[]),  # no coalescing route at all
        tasks.create(routes=["coalesce.v1.k", "coalesce.v1.extra"]),  # not the same routes
        tasks.create(routes=["coalesce.v2.k"]),  # another prefix
    ]
    missing = "fN1x3yDmQdC1o5mB5ZcS0A"  # no such task
    superseder.lists["k"] = [initial, *foreign, missing]

    report = await shim.run((await claim_work(shim))[0], ran_alone)

    assert report.primary == (initial, 0) and report.superseded == []
    for task_id in foreign:
        assert tasks.status(task_id)["state"] == "pending", task_id
        assert len(tasks.status(task_id)["runs"]) == 1


async def test_an_oversized_list_is_capped_to_the_newest_tasks(
    queue_emulator: QueueEmulator, options: Options, tasks: Tasks, superseder: Superseder
) -> None:
    ids = [tasks.create() for _ in range(5)]
    superseder.lists["k"] = ids
    capped = dataclasses.replace(options, max_tasks=3)
    async with make_shim(queue_emulator, capped) as shim:
        report = await shim.run((await claim_work(shim))[0], ran_alone_or_primary)
    assert report.primary == (ids[-1], 0)
    assert report.superseded == [(ids[0], 0), (ids[-2], 0)]
    assert [tasks.status(t)["state"] for t in ids[1:3]] == ["pending", "pending"]


async def ran_alone_or_primary(claim: Claim, supersedes: Sequence[Superseded]) -> Outcome:
    return COMPLETED
