"""The reference worker: command payloads, logs, limits, and two workers racing on one key."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from coalescer.emulator.harness import QueueEmulator
from coalescer.worker import Options, Shim
from coalescer.worker.runner import MalformedPayload, parse_payload
from tests.integration.test_serve import zombie
from tests.worker.support import QUEUE, Superseder, Tasks, make_shim, poll, resolved, running

CLAIM_TIMEOUT = 1200  # the emulator's seconds per claim

LOG = "public/logs/live.log"


async def test_a_command_runs_with_its_ids_and_its_log_is_uploaded(
    shim: Shim, tasks: Tasks
) -> None:
    command = ["sh", "-c", 'echo "hello $GREETING $TASK_ID/$RUN_ID"; env']
    ok = tasks.create(url="", payload={"command": command, "env": {"GREETING": "from"}})
    bad = tasks.create(url="", payload={"command": ["sh", "-c", "exit 3"]})
    async with running(shim):
        await poll(resolved(tasks, ok, bad))
    assert tasks.last_run(ok)["state"] == "completed"
    log = tasks.artifact(ok, 0, LOG)
    assert f"hello from {ok}/0" in log
    assert "TASKCLUSTER" not in log  # the worker's own environment stays out
    assert tasks.last_run(bad)["state"] == "failed"
    assert "exit code 3" in tasks.artifact(bad, 0, LOG)


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        ({}, "payload.command"),
        ({"command": "echo hi"}, "payload.command"),
        ({"command": ["true"], "env": {"A": 1}}, "payload.env"),
        ({"command": ["true"], "maxRunTime": -1}, "payload.maxRunTime"),
        ({"command": ["/no/such/program"]}, "cannot start"),
    ],
)
async def test_a_malformed_payload_is_an_exception_explained_in_the_log(
    payload: dict[str, Any], why: str, shim: Shim, tasks: Tasks
) -> None:
    task_id = tasks.emulator.create_task(taskQueueId=QUEUE, payload=payload)
    async with running(shim):
        await poll(resolved(tasks, task_id))
    run = tasks.last_run(task_id)
    assert (run["state"], run["reasonResolved"]) == ("exception", "malformed-payload")
    assert why in tasks.artifact(task_id, 0, LOG)


async def test_max_run_time_kills_the_command_and_fails_the_task(shim: Shim, tasks: Tasks) -> None:
    task_id = tasks.create(url="", payload={"command": ["sleep", "30"], "maxRunTime": 0.5})
    async with running(shim):
        await poll(resolved(tasks, task_id))
    assert tasks.last_run(task_id)["state"] == "failed"
    assert "maxRunTime of 0.5 s exceeded" in tasks.artifact(task_id, 0, LOG)


def _pipes_of(pid: int | str) -> set[str]:
    fds = Path(f"/proc/{pid}/fd")
    links = set()
    for fd in fds.iterdir():
        with contextlib.suppress(OSError):  # closed since listed
            links.add(os.readlink(fd))
    return {link for link in links if link.startswith("pipe:")}


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists() and not zombie(pid)


async def test_what_a_command_left_running_in_its_process_group_ends_with_it(
    shim: Shim, tasks: Tasks
) -> None:
    command = ["sh", "-c", "sleep 60 & echo $!"]
    task_id = tasks.create(url="", payload={"command": command})
    async with running(shim):
        await poll(resolved(tasks, task_id))
    assert tasks.last_run(task_id)["state"] == "completed"
    log = tasks.artifact(task_id, 0, LOG)
    left = int(next(line for line in log.splitlines() if line.isdigit()))
    try:
        await poll(lambda: not _alive(left), within=5, what="the command's child gone")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(left, signal.SIGKILL)
    assert "no longer read" not in log  # killed with the command: its output ended


@pytest.mark.parametrize(("max_run_time", "outcome"), [(60, "completed"), (0.5, "failed")])
async def test_a_process_left_behind_holding_the_output_neither_stalls_the_run_nor_leaks_the_pipe(
    max_run_time: float, outcome: str, shim: Shim, tasks: Tasks, tmp_path: Path
) -> None:
    # The command starts a process in a session of its own (beyond the reach of the kill of its
    # process group) that inherits its output, then ends or overruns its maxRunTime.
    pid_file = tmp_path / "pid"
    leave_behind = (
        "import signal, subprocess, sys; "
        "p = subprocess.Popen([sys.executable, '-c', 'import signal; signal.pause()'],"
        " start_new_session=True); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); print('left', flush=True); "
        "sys.argv[1] == 'overrun' and signal.pause()"  # until killed at its maxRunTime
    )
    command = [sys.executable, "-c", leave_behind, "end" if outcome == "completed" else "overrun"]
    task_id = tasks.create(url="", payload={"command": command, "maxRunTime": max_run_time})
    try:
        async with running(shim):
            await poll(resolved(tasks, task_id), within=20)
        assert tasks.last_run(task_id)["state"] == outcome
        log = tasks.artifact(task_id, 0, LOG)
        assert "left\n" in log
        assert "still holds the command's output" in log
        held = _pipes_of(pid_file.read_text())
        assert held and not held & _pipes_of("self"), "the worker kept the pipe open"
    finally:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


async def test_the_primary_command_sees_what_it_supersedes(
    shim: Shim, tasks: Tasks, superseder: Superseder
) -> None:
    show = ["sh", "-c", 'cat "$COALESCER_SUPERSEDES_FILE"; echo']
    ids = [tasks.create(payload={"command": show}) for _ in range(3)]
    superseder.lists["k"] = ids
    async with running(shim):
        await poll(resolved(tasks, *ids))
    log = tasks.artifact(ids[-1], 0, LOG)
    shown = orjson.loads(next(line for line in log.splitlines() if line.startswith("[{")))
    assert [(s["taskId"], s["runId"]) for s in shown] == [(ids[0], 0), (ids[1], 0)]
    assert all(s["task"]["routes"] == ["coalesce.v1.k"] for s in shown)


async def test_two_workers_on_one_key_run_no_task_twice_and_lose_none(
    queue_emulator: QueueEmulator, options: Options, tasks: Tasks, superseder: Superseder
) -> None:
    ids = [tasks.create(payload={"command": ["sh", "-c", "sleep 0.2"]}) for _ in range(10)]
    superseder.lists["k"] = ids  # a superseder that lists everything, stale or not
    async with (
        make_shim(queue_emulator, options, "w1") as one,
        make_shim(queue_emulator, options, "w2") as two,
        running(one, two, capacity=2) as workers,
    ):
        await poll(resolved(tasks, *ids), within=20)
    ran, superseded_by = [], {}
    for task_id in ids:
        status = tasks.status(task_id)
        assert len(status["runs"]) == 1, f"{task_id} ran more than once"
        run = status["runs"][0]
        if run["reasonResolved"] == "completed":
            ran.append(task_id)
        else:
            assert run["reasonResolved"] == "superseded"
            superseded_by[task_id] = tasks.artifact(task_id, 0, "public/superseded-by.json")
    assert ran and len(ran) + len(superseded_by) == len(ids)
    for task_id, primary in superseded_by.items():
        assert primary["taskId"] in ran
        assert ids.index(primary["taskId"]) > ids.index(task_id)  # only newer supersedes older
        listed = tasks.artifact(primary["taskId"], 0, "public/supersedes.json")
        assert {"taskId": task_id, "runId": 0} in listed
    assert ids[-1] in ran
    assert sorted(r.primary[0] for w in workers for r in w.reports if not r.aborted) == sorted(ran)


async def test_sigterm_releases_the_running_task_with_worker_shutdown(
    queue_emulator: QueueEmulator, tasks: Tasks, superseder: Superseder
) -> None:
    task_id = tasks.create(payload={"command": ["sleep", "60"]})
    env = {
        **os.environ,
        "TASKCLUSTER_ROOT_URL": queue_emulator.root_url,
        "TASKCLUSTER_CLIENT_ID": "worker",
        "TASKCLUSTER_ACCESS_TOKEN": "no-secret",
        "COALESCER_LOG_FORMAT": "text",
    }
    argv = [sys.executable, "-m", "coalescer.cli", "worker", "--task-queue-id", QUEUE]
    argv += ["--worker-group", "wg", "--worker-id", "cli", "--superseder-allow", superseder.url]
    proc = await asyncio.create_subprocess_exec(*argv, env=env, stderr=subprocess.PIPE)
    try:
        await poll(lambda: tasks.last_run(task_id)["state"] == "running", within=15)
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(15):
            _, stderr = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, stderr.decode()
    first = tasks.status(task_id)["runs"][0]
    assert (first["state"], first["reasonResolved"]) == ("exception", "worker-shutdown")
    assert tasks.last_run(task_id)["state"] == "pending"


def test_payload_defaults() -> None:
    payload = parse_payload({"command": ["true"]})
    assert payload.max_run_time == 3600 and payload.env == {}


async def test_a_canceled_command_gets_sigterm_and_its_on_cancel_hook(
    shim: Shim, tasks: Tasks, queue_emulator: QueueEmulator, tmp_path: Any
) -> None:
    mark = tmp_path / "mark"
    command = [
        "sh",
        "-c",
        'trap "echo term >> $MARK; exit 0" TERM; echo started >> $MARK; sleep 60 & wait',
    ]
    task_id = tasks.create(
        url="",
        payload={
            "command": command,
            "env": {"MARK": str(mark)},
            "onCancel": ["sh", "-c", "echo hook >> $MARK"],
        },
    )
    async with running(shim):
        await poll(lambda: mark.exists() and "started" in mark.read_text())
        await asyncio.to_thread(queue_emulator.queue().cancelTask, task_id)
        # Time to reclaim, which answers 409: the shim stops the command.
        await asyncio.to_thread(queue_emulator.clock.advance, CLAIM_TIMEOUT / 2)
        await poll(lambda: "hook" in mark.read_text() and "term" in mark.read_text())
    assert tasks.last_run(task_id)["reasonResolved"] == "canceled"


def test_on_cancel_must_be_a_command() -> None:
    assert parse_payload({"command": ["true"], "onCancel": ["rm", "x"]}).on_cancel == ("rm", "x")
    with pytest.raises(MalformedPayload, match="onCancel"):
        parse_payload({"command": ["true"], "onCancel": "rm x"})
