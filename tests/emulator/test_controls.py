"""The emulator's own surface: clock control, message log, CLI, the pytest plugin."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import httpx
import pytest

from coalescer.emulator import cli
from coalescer.emulator.clock import Clock, parse_time
from coalescer.emulator.harness import TEST_OPTIONS, QueueEmulator
from coalescer.emulator.runtime import EmulatorOptions
from coalescer.emulator.server import KEEP_ALIVE_SECONDS
from coalescer.errors import ConfigError
from coalescer.settings import Settings

from .conftest import CheckedQueue, claim_one, poll


def test_the_clock_can_be_advanced_over_http_and_claims_expire(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    task_id = em.create_task(retries=0)
    claim_one(em, queue, task_id)
    with httpx.Client(base_url=em.root_url) as http:
        before = parse_time(http.get("/emulator/v1/clock").json()["now"])
        moved = http.post("/emulator/v1/clock", json={"advance": 1300})
        assert moved.status_code == 200
        assert (parse_time(moved.json()["now"]) - before).total_seconds() >= 1300
        assert http.post("/emulator/v1/clock", json={"advance": -1}).status_code == 400
        found = http.get("/emulator/v1/messages", params={"taskId": task_id}).json()["messages"]
    assert [m["exchange"].rsplit("/", 1)[1] for m in found][-1] == "task-exception"
    assert queue.status(task_id)["status"]["runs"][0]["reasonResolved"] == "claim-expired"


def test_the_clock_is_not_controllable_over_http_unless_asked() -> None:
    options = dataclasses.replace(TEST_OPTIONS, controllable_clock=False)
    with QueueEmulator(options) as emulator, httpx.Client(base_url=emulator.root_url) as http:
        refused = http.post("/emulator/v1/clock", json={"advance": 10})
        assert refused.status_code == 404
        assert refused.json()["code"] == "ResourceNotFound"


def test_a_frozen_clock_moves_only_when_advanced() -> None:
    clock = Clock(frozen=True)
    start = clock.now()
    assert clock.now() == start
    assert (clock.advance(1.5) - start).total_seconds() == 1.5
    with pytest.raises(ValueError):
        clock.advance(-1)


def test_unknown_routes_answer_in_the_queue_error_shape(em: QueueEmulator) -> None:
    with httpx.Client(base_url=em.root_url) as http:
        missing = http.get("/api/queue/v1/no/such/thing")
        unimplemented = http.get("/api/queue/v1/provisioners")
        bad_id = http.get("/api/queue/v1/task/not-a-slug/status")
    assert missing.status_code == 404 and missing.json()["code"] == "ResourceNotFound"
    assert unimplemented.status_code == 404
    assert "does not implement listProvisioners" in unimplemented.json()["message"]
    assert bad_id.status_code == 400 and bad_id.json()["code"] == "InvalidRequestArguments"


def test_an_idle_connection_outlives_the_clients_own_keep_alive(em: QueueEmulator) -> None:
    # A client closes an idle connection after its own keep-alive (aiohttp, the taskcluster
    # client's; httpx): the server must keep it longer, or a request sent as it closes fails.
    aiohttp_keeps = 15.0  # aiohttp.TCPConnector's documented keepalive_timeout
    httpx_keeps = httpx.Limits().keepalive_expiry
    assert httpx_keeps is not None
    served = em._server.config.timeout_keep_alive
    assert served == KEEP_ALIVE_SECONDS > max(aiohttp_keeps, httpx_keeps)


def test_the_cli_adds_an_emulator_subcommand_with_its_flags() -> None:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    defaults = parser.parse_args(["emulator"])
    assert (defaults.host, defaults.port, defaults.legacy) == ("127.0.0.1", 8081, False)
    assert defaults.handler is cli.run
    assert defaults.deadline_delay == EmulatorOptions().deadline_delay == 60.0  # the real queue's
    flags = ["--port", "9", "--pulse-url", "amqp://x", "--publish-to", "http://y/v1/events"]
    args = parser.parse_args(["emulator", *flags, "--legacy", "--controllable-clock"])
    assert (args.port, args.pulse_url, args.publish_to) == (9, "amqp://x", "http://y/v1/events")
    assert args.legacy and args.controllable_clock
    assert parser.parse_args(["emulator", "--deadline-delay", "0"]).deadline_delay == 0.0
    negative = parser.parse_args(["emulator", "--deadline-delay", "-1"])
    with pytest.raises(ConfigError, match="--deadline-delay"):
        cli.run(negative, Settings.from_environ({}))


def test_the_claim_timeout_is_a_flag_as_the_real_queues_task_claim_timeout() -> None:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    settings = Settings.from_environ({})
    default = cli.options(parser.parse_args(["emulator"]), settings)
    assert default.claim_timeout == 1200.0  # the real queue's default
    short = cli.options(parser.parse_args(["emulator", "--claim-timeout", "60"]), settings)
    assert short.claim_timeout == 60.0
    # A claim made on that emulator is taken for 60 s.
    with QueueEmulator(dataclasses.replace(TEST_OPTIONS, claim_timeout=60.0)) as em:
        task_id = em.create_task()
        claimed = em.queue().claimTask(task_id, "0", {"workerGroup": "g", "workerId": "w"})
        taken = parse_time(claimed["takenUntil"]) - em.clock.now()
        assert abs(taken.total_seconds() - 60) < 5, taken
    for bad in ("0", "-1"):
        with pytest.raises(ConfigError, match="--claim-timeout must be more than 0"):
            cli.options(parser.parse_args(["emulator", "--claim-timeout", bad]), settings)


def test_importing_the_pytest_plugin_has_no_side_effects() -> None:
    code = (
        "import sys; import coalescer.emulator.fixture as f; "
        "heavy = {'uvicorn', 'starlette', 'taskcluster', 'aio_pika'} & set(sys.modules); "
        "assert not heavy, heavy; assert callable(f.queue_emulator)"
    )
    subprocess.run([sys.executable, "-W", "error", "-c", code], check=True)


def test_expiry_is_also_applied_in_the_background_without_requests(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    task_id = em.create_task(retries=1)
    claim_one(em, queue, task_id)
    em.emulator.clock.advance(1201)  # the bare clock: nothing is applied until the next check
    retried = poll(
        lambda: [m for m in em.messages("task-pending", task_id) if m["payload"]["runId"]]
    )
    assert retried[0]["payload"]["status"]["runs"][0]["reasonResolved"] == "claim-expired"


def test_a_task_page_stands_in_for_the_taskcluster_ui(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    task_id = em.create_task(retries=0)
    claim = claim_one(em, queue, task_id)
    assert claim["runId"] == 0
    with httpx.Client(base_url=em.root_url) as http:
        page = http.get(f"/tasks/{task_id}")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert task_id in page.text and "<td>running</td>" in page.text
        assert f'href="/api/queue/v1/task/{task_id}/status"' in page.text
        missing = http.get("/tasks/nOtAtAsKiDaTaLl12345678")
        assert missing.status_code == 404 and "does not exist" in missing.text
        root = http.get("/")  # the rootUrl the demo prints: its tasks, linked
        assert root.status_code == 200 and f'href="/tasks/{task_id}"' in root.text
