"""A bisection's finding reported to the superseder service (``POST /v1/bisections``): what the
worker sends, where, with which token, and that a failed report changes nothing for the tasks."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

import httpx
import pytest

from coalescer import cli
from coalescer.emulator.harness import QueueEmulator
from coalescer.errors import ConfigError
from coalescer.settings import Secret, Settings
from coalescer.verdicts import DEFAULT_FLAKE, Verdict
from coalescer.web.bisections import check
from coalescer.worker import Options
from coalescer.worker import cli as worker_cli
from coalescer.worker.culprit import Attempt, Finding
from coalescer.worker.findings import finding_json, flake_rate, report_url, reported_key
from tests.worker.support import Tasks, claim_work, make_shim
from tests.worker.test_bisect import Pushes, bisecting
from tests.worker.test_with_service import feed, service  # noqa: F401 (a fixture)

T = [f"{c}N1SbArXTPSVFNUvaOlinQ" for c in "abcdef"]
AT = datetime(2026, 1, 1, 1, 0, tzinfo=UTC)


def test_the_finding_is_sent_in_the_services_shape() -> None:
    found = Finding(
        held=5,
        culprit=(T[3], 0),
        last_good=(T[2], 1),
        runs=[
            Attempt(T[5], 0, 0, False, AT),
            Attempt(T[2], 1, 0, True, AT.replace(minute=10, microsecond=123_456)),
            Attempt(T[3], 0, 0, False, None),
        ],
        intermittent=[(T[4], 0)],
        # In the order the search concluded them, not the pushes' order.
        stood_for={(T[1], 0): (T[2], 1), (T[0], 0): (T[2], 1)},
    )
    body = finding_json(found, key="k", by="worker g/w", primary=(T[5], 0), located=AT, listed=T)
    assert body == {
        "key": "k",
        "by": "worker g/w",
        "primary": {"taskId": T[5], "runId": 0},
        "held": 5,
        "culprit": {"taskId": T[3], "runId": 0},
        "lastGood": {"taskId": T[2], "runId": 1},
        "runs": [
            {
                "taskId": T[5],
                "runId": 0,
                "attempt": 0,
                "passed": False,
                "ended": "2026-01-01T01:00:00.000Z",
            },
            {
                "taskId": T[2],
                "runId": 1,
                "attempt": 0,
                "passed": True,
                "ended": "2026-01-01T01:10:00.123Z",
            },
            {"taskId": T[3], "runId": 0, "attempt": 0, "passed": False, "ended": None},
        ],
        "intermittent": [{"taskId": T[4], "runId": 0}],
        "standsFor": [
            {"taskId": T[0], "runId": 0, "by": {"taskId": T[2], "runId": 1}},
            {"taskId": T[1], "runId": 0, "by": {"taskId": T[2], "runId": 1}},
        ],
        "extraRuns": 2,
        "rounds": 2,
        "located": "2026-01-01T01:00:00.000Z",
        "flake": 0.05,  # a search that stopped: no verdict
    }
    assert check(body) == body  # what the service accepts
    found.verdict, found.probability = Verdict.CULPRIT, 0.9996
    body = finding_json(found, key="k", by="worker g/w", primary=(T[5], 0), located=AT, listed=T)
    assert (body["verdict"], body["probability"], body["suspect"]) == ("culprit", 0.9996, None)
    assert check(body) == body


def test_the_keys_flake_rate_is_read_from_the_services_findings() -> None:
    steady = {"runs": [{"passed": True}] * 4, "intermittent": []}
    flaky = {"runs": [{"passed": True}] * 4, "intermittent": [{"taskId": T[0], "runId": 0}]}
    assert flake_rate({"findings": [steady] * 5}) < DEFAULT_FLAKE
    assert flake_rate({"findings": [flaky] * 5}) == pytest.approx(6 / 45)
    for unusable in (None, [], {"findings": "x"}, {"error": "no"}):
        assert flake_rate(unusable) == DEFAULT_FLAKE


def test_the_report_goes_to_the_service_the_superseder_url_names() -> None:
    routes = ["coalesce.v1.other", "coalesce.v1.build.linux"]
    for url in (
        "https://c.example/build/linux",
        "https://c.example/v1/docker-worker/build.linux",
        "https://c.example/v1/list/10/2/build.linux",
    ):
        assert reported_key(url, routes, "coalesce.v1") == "build.linux", url
        assert report_url(url, routes, "coalesce.v1") == "https://c.example/v1/bisections", url
    assert reported_key("https://c.example/elsewhere", routes, "coalesce.v1") is None
    assert report_url("https://c.example/elsewhere", routes, "coalesce.v1") is None


async def bisect_through(
    service: str,  # noqa: F811
    settings: Settings,
    queue_emulator: QueueEmulator,
    tasks: Tasks,
    options: Options,
) -> list[str]:
    """Nine pushes of key ``k`` whose tasks fail from push 5 on, bisected by a shim asking
    ``service``: returns their taskIds once the task set is done."""
    ids = [tasks.create(url=f"{service}/k") for _ in range(9)]
    await feed(service, queue_emulator, settings)
    async with make_shim(queue_emulator, options) as shim:
        report = await shim.run((await claim_work(shim))[0], Pushes(ids, first_bad=5))
    assert report.bisection is not None and report.bisection.culprit == (ids[4], 0)
    return ids


async def test_the_culprit_is_found_on_the_service_after_a_bisection(
    service: str,  # noqa: F811
    settings: Settings,
    queue_emulator: QueueEmulator,
    tasks: Tasks,
    options: Options,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("DEBUG")
    configured = dataclasses.replace(
        bisecting(options, 0), allow=(service,), report_token=Secret("s3cret")
    )
    ids = await bisect_through(service, settings, queue_emulator, tasks, configured)

    async with httpx.AsyncClient(base_url=service) as client:
        culprit = (await client.get(f"/v1/tasks/{ids[4]}")).json()
        [found] = culprit["bisection"]
        assert found["role"] == "culprit" and found["key"] == "k"
        assert found["culprit"] == {"taskId": ids[4], "runId": 0}
        assert found["lastGood"] == {"taskId": ids[3], "runId": 0}
        assert found["primary"] == {"taskId": ids[8], "runId": 0}
        assert found["by"] == "worker wg/w1" and found["held"] == 8 and found["extraRuns"] == 3
        # The key had no findings: the prior's flake rate, and a failure trusted (confirm 0).
        assert found["verdict"] == "culprit" and found["flake"] == 0.05
        assert 0.9 < found["probability"] < 0.99
        assert [(r["taskId"], r["passed"]) for r in found["runs"]] == [
            (ids[8], False),
            (ids[3], True),
            (ids[5], False),
            (ids[4], False),
        ]
        assert [s["taskId"] for s in found["standsFor"]] == [*ids[:3], *ids[6:8]]
        roles = [(await client.get(f"/v1/tasks/{t}")).json()["bisection"][0]["role"] for t in ids]
        assert roles == ["stoodFor"] * 3 + ["lastGood", "culprit", "ran"] + ["stoodFor"] * 2 + [
            "primary"
        ]
        page = (await client.get(f"/tasks/{ids[4]}", headers={"accept": "text/html"})).text
        assert "This task is the <b>culprit</b>" in page
    assert any("reported to" in r.getMessage() for r in caplog.records)
    # The search asked the service for the key's findings before it ran (none yet).
    assert any("the key's flake rate is 0.050" in r.getMessage() for r in caplog.records)
    assert "s3cret" not in caplog.text


async def test_a_refused_report_is_a_warning_and_the_tasks_end_as_usual(
    service: str,  # noqa: F811
    settings: Settings,
    queue_emulator: QueueEmulator,
    tasks: Tasks,
    options: Options,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("DEBUG")
    configured = dataclasses.replace(
        bisecting(options, 0), allow=(service,), report_token=Secret("wrong-token")
    )
    ids = await bisect_through(service, settings, queue_emulator, tasks, configured)

    states = [tasks.last_run(t)["reasonResolved"] for t in ids]
    assert states == ["superseded"] * 3 + ["completed", "failed", "failed"] + ["superseded"] * 2 + [
        "failed"
    ]
    [warning] = [r for r in caplog.records if "not reported" in r.getMessage()]
    assert warning.levelname == "WARNING" and "HTTP 401" in warning.getMessage()
    assert "wrong-token" not in caplog.text
    async with httpx.AsyncClient(base_url=service) as client:
        assert (await client.get(f"/v1/tasks/{ids[4]}")).status_code == 404


async def test_the_token_goes_only_under_an_allowed_prefix(
    service: str,  # noqa: F811
    settings: Settings,
    queue_emulator: QueueEmulator,
    tasks: Tasks,
    options: Options,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The superseder's URL is allowed, the service's /v1/bisections is not.
    configured = dataclasses.replace(
        bisecting(options, 0), allow=(f"{service}/k",), report_token=Secret("s3cret")
    )
    ids = await bisect_through(service, settings, queue_emulator, tasks, configured)

    [warning] = [r for r in caplog.records if "not reported" in r.getMessage()]
    assert "not under an allowed prefix" in warning.getMessage()
    async with httpx.AsyncClient(base_url=service) as client:
        assert (await client.get(f"/v1/tasks/{ids[4]}")).status_code == 404


def test_the_command_line_takes_the_report_token_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, settings: Settings
) -> None:
    chosen: list[Options] = []

    async def main(args: object, tc: object, options: Options) -> None:
        chosen.append(options)

    monkeypatch.setattr(worker_cli, "_main", main)
    monkeypatch.setenv("TASKCLUSTER_ROOT_URL", "http://queue.invalid")
    monkeypatch.setenv("MY_REPORT_TOKEN", "from-the-env")
    base = ["worker", "--task-queue-id", "p/w", "--worker-group", "g", "--worker-id", "i"]
    parser = cli.build_parser()
    worker_cli.handle(parser.parse_args([*base, "--report-token-env", "MY_REPORT_TOKEN"]), settings)
    worker_cli.handle(parser.parse_args(base), settings)  # settings hold COALESCER_INGEST_TOKEN
    without = dataclasses.replace(settings, ingest_token=None)
    worker_cli.handle(parser.parse_args(base), without)
    assert [o.report_token for o in chosen] == [Secret("from-the-env"), Secret("s3cret"), None]
    assert "from-the-env" not in repr(chosen[0])
    with pytest.raises(ConfigError, match="NOT_SET is not set"):
        worker_cli.handle(parser.parse_args([*base, "--report-token-env", "NOT_SET"]), settings)
