"""Recording for replay: ``coalescer listen --record`` on the real RabbitMQ writes every applied
event as a Pulse-shaped line, ``coalescer replay --events`` reads the file back as the same
tasks, the size bound holds across a rotation, and ``POST /v1/events`` records with
``COALESCER_RECORD_FILE``."""

# The broker and prefix fixtures are shared with test_pulse.py by importing them, which pytest
# supports and ruff takes for redefinitions.
# ruff: noqa: F811

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import orjson

from coalescer.settings import Settings
from coalescer.store import Store
from coalescer.web.app import create_app
from tests.conftest import make_message
from tests.integration.test_pulse import (  # noqa: F401  (fixtures)
    Broker,
    bind_queue,
    broker,
    eventually,
    ids,
    prefix,
    primary_key,
    routes,
)
from tests.integration.test_pulse_process import (  # noqa: F401  (fixtures)
    Listen,
    _true,
    listen_env,
    processes,
)


def listen_recording(path: Path, *options: str) -> str:
    """``coalescer listen --record path`` as the code of a ``python -c``."""
    args = ["listen", "--declare-exchanges", "--record", str(path), *options]
    return f"import sys\nfrom coalescer import cli\nsys.exit(cli.main({args!r}))\n"


def at(second: int) -> str:
    return f"2030-01-01T00:{second // 60:02d}:{second % 60:02d}.000Z"


def history(prefix: str, task_ids: list[str]) -> list[dict[str, Any]]:
    """Each task pending, then completed; every other one on a second key."""
    pending, completed = [], []
    for i, t in enumerate(task_ids):
        keys = ("a", "b") if i % 2 else ("a",)
        pending.append(make_message(t, routes=routes(prefix, *keys), scheduled=at(i)))
        completed.append(
            make_message(t, "completed", routes=routes(prefix, *keys), scheduled=at(i))
        )
    return pending + completed


def sizes(folder: Path, prefix: str) -> dict[str, int]:
    """The files in ``folder`` whose names start with ``prefix``, by name, with their sizes."""
    return {n: os.path.getsize(folder / n) for n in os.listdir(folder) if n.startswith(prefix)}


def as_published(recorded: dict[str, Any], sent: dict[str, Any], routing_key: str) -> bool:
    """``recorded`` is ``sent`` as published with ``routing_key`` and validated: the schema's
    defaults (the status's priority) filled in."""
    status = sent["payload"]["status"]
    return (
        (recorded["exchange"], recorded["routingKey"], recorded["CC"])
        == (sent["exchange"], routing_key, sent["CC"])
        and {k: recorded["payload"]["status"][k] for k in status} == status
        and {**recorded["payload"], "status": status} == sent["payload"]
    )


def lines(*paths: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for p in paths if p.exists() for line in p.read_bytes().splitlines()]


async def test_listen_records_what_replay_reads_back(
    listen_env: dict[str, str],
    store: Store,  # an empty Redis, emptied again afterwards
    broker: Broker,
    prefix: str,
    tmp_path: Path,
    processes: list[Listen],
) -> None:
    record = tmp_path / "events.jsonl"
    tasks = ids(40)
    sent = history(prefix, tasks)
    await bind_queue(broker, prefix)
    listen = Listen(listen_env, tmp_path / "listen.log", listen_recording(record))
    processes.append(listen)
    await listen.started()
    await broker.publish_all(sent)
    await eventually(lambda: _true(len(lines(record)) == len(sent)), what="every event recorded")
    listen.proc.send_signal(signal.SIGTERM)
    assert await listen.exited() == 0, listen.output()

    recorded = lines(record)
    assert len(recorded) == len(sent)  # nothing more came after the wait either
    assert {(m["exchange"], m["payload"]["status"]["taskId"]) for m in recorded} == {
        (m["exchange"], m["payload"]["status"]["taskId"]) for m in sent
    }
    by_task = {(m["exchange"], m["payload"]["status"]["taskId"]): m for m in sent}
    for m in recorded:
        original = by_task[(m["exchange"], m["payload"]["status"]["taskId"])]
        assert as_published(m, original, primary_key(original))

    done = subprocess.run(  # noqa: ASYNC221  (the test waits for nothing else meanwhile)
        [
            sys.executable,
            "-m",
            "coalescer.cli",
            "replay",
            "--events",
            str(record),
            "--workers",
            "2",
            "--json",
        ],
        env=listen_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    doc = orjson.loads(done.stdout)
    assert doc["history"]["tasks"] == len(tasks)
    assert doc["history"]["keys"] == 2
    for c in doc["configurations"]:
        assert c["tasks"] == len(tasks) and c["lost"] == 0


async def test_the_record_stays_within_two_files_of_the_limit(
    listen_env: dict[str, str],
    store: Store,  # an empty Redis, emptied again afterwards
    broker: Broker,
    prefix: str,
    tmp_path: Path,
    processes: list[Listen],
) -> None:
    record = tmp_path / "events.jsonl"
    older = Path(f"{record}.1")
    limit = 20_000
    sent = history(prefix, ids(60))  # about 1.5 kB a line: several limits' worth
    await bind_queue(broker, prefix)
    listen = Listen(
        listen_env,
        tmp_path / "listen.log",
        listen_recording(record, "--record-max-bytes", str(limit), "--batch", "1"),
    )
    processes.append(listen)
    await listen.started()
    await broker.publish_all(sent)
    newest = sent[-1]["payload"]["status"]["taskId"]
    await eventually(
        lambda: _true(any(m["payload"]["status"]["taskId"] == newest for m in lines(record))),
        what="the last event recorded",
    )
    listen.proc.send_signal(signal.SIGTERM)
    assert await listen.exited() == 0, listen.output()
    files = sizes(tmp_path, "events")
    assert sorted(files) == [record.name, older.name]
    assert all(0 < size <= limit for size in files.values()), files
    kept = lines(older, record)
    assert len(kept) < len(sent)
    # What is kept is the newest, in the order it was applied.
    assert [m["payload"]["status"]["taskId"] for m in kept] == [
        m["payload"]["status"]["taskId"] for m in sent[len(sent) - len(kept) :]
    ]


async def test_post_events_records_with_the_setting(
    redis_url: str, store: Store, tmp_path: Path
) -> None:
    record = tmp_path / "posted.jsonl"
    settings = Settings.from_environ(
        {
            "REDIS_URL": redis_url,
            "COALESCER_INGEST_TOKEN": "s3cret",
            "COALESCER_RECORD_FILE": str(record),
        }
    )
    a, b = ids(2)
    applied = make_message(a, routes=("coalesce.v1.k",))
    unrouted = make_message(b, routes=("index.elsewhere",))
    app = create_app(settings, store)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
            r = await c.post(
                "/v1/events",
                json=[applied, unrouted, {"exchange": 1}],
                headers={"authorization": "Bearer s3cret"},
            )
            assert [x["status"] for x in r.json()["results"]] == ["applied", "ignored", "invalid"]
    assert app.state.recorder is None  # closed with the app: everything is written
    [recorded] = lines(record)
    assert as_published(recorded, applied, applied["routingKey"])
