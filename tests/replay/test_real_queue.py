"""Histories recorded on a real Taskcluster queue (release 106, the local kit), kept in
``histories/`` by ``scripts/record_history.py``: worker shims with their workers up; the
enforcer under latest-wins; the enforcer bisecting; a worker shim bisecting; a pool started
after the pushes. Each is the task group as ``coalescer replay --task-group --save`` read it
(the queue's answers, the runs' links, the service's findings) and the Pulse messages
``coalescer listen`` applied.

Replayed under the configuration that was on, each reproduces every task's fate (ran,
superseded by the same final primary, never scheduled) and its worker time and makespan
within :data:`TOLERANCE`; ``off`` runs every task on the pool that really ran.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from coalescer.errors import InvalidInput
from coalescer.policy.rules import loads
from coalescer.replay import recorded, sources
from coalescer.replay.history import History
from coalescer.replay.pool import Outcome, State
from coalescer.replay.runner import Config, replay
from coalescer.store import open_store
from tests.replay.test_live_runs import final, replayed

HERE = Path(__file__).parent / "histories"
#: The issue's bar for real queues (the emulator's histories keep the model page's 1%).
TOLERANCE = 0.05

LATEST_WINS = """\
rules:
  - {name: builds, keys: build, strategy: latest-wins}
  - {name: mac, keys: mac, strategy: latest-wins}
"""
BISECT = """\
rules:
  - {name: bisect, keys: build, strategy: latest-wins, on-primary-failure: bisect}
"""


def policy(text: str) -> Config:
    return Config.from_policy(loads(text, "policy.yaml", toml=False), "policy.yaml")


#: Each history, the configuration that was on, and what happened: tasks run, superseded,
#: never scheduled.
HISTORIES = {
    "shim": (Config(True), (13, 3, 2)),
    "latest-wins": (policy(LATEST_WINS), (13, 3, 2)),
    "enforcer-bisect": (policy(BISECT), (4, 4, 0)),
    "shim-bisect": (Config.parse("on-claim,on-primary-failure=bisect"), (4, 4, 0)),
    "late-pool": (Config(True), (2, 8, 0)),
}


def read(name: str) -> History:
    answers = recorded.Answers.load(HERE / f"{name}.json")
    queue, evidence, groups = recorded.replaying(answers)
    assert answers.prefix is not None
    return sources.from_task_groups(
        queue, groups, prefix=answers.prefix, rank_tag=None, evidence=evidence
    )


def run(history: History, *configs: Config) -> list[Outcome]:
    async def go() -> list[Outcome]:
        store = await open_store(None, grace_seconds=3600)
        try:
            return await replay(history, configs, store)
        finally:
            await store.close()

    return asyncio.run(go())


def without_lags(history: History) -> History:
    """``history`` as the model read it before it knew the queue's lags: one median resolver
    lag for every dependent, no claim wait, no time to hold."""
    tasks = tuple(
        dataclasses.replace(t, lag_ms=None, wait_ms=None, hold_ms=None) for t in history.tasks
    )
    return dataclasses.replace(history, tasks=tasks, claim_wait_ms=0, hold_ms=0)


def happened(history: History) -> dict[str, str]:
    """Each task's fate as recorded, as :func:`replayed` says it of a replay."""
    found = {}
    for t in history.tasks:
        if t.superseded_ms:
            found[t.task_id] = "superseded by " + t.superseded_by
        elif t.real_runs:
            found[t.task_id] = "ran"
        else:
            found[t.task_id] = "never scheduled"
    return found


@pytest.mark.parametrize("name", list(HISTORIES))
def test_the_configuration_that_was_on_reproduces_what_happened(name: str) -> None:
    config, (ran, superseded, never) = HISTORIES[name]
    history = read(name)
    lived = happened(history)
    words = [what.split()[0] for what in lived.values()]
    assert (words.count("ran"), words.count("superseded"), words.count("never")) == (
        ran,
        superseded,
        never,
    )
    off, on = run(history, Config(False), config)
    assert final(replayed(history, on)) == final(lived)
    recorded_ = history.recorded()
    assert recorded_ is not None
    assert abs(on.worker_ms - recorded_.worker_ms) <= TOLERANCE * recorded_.worker_ms
    makespan = max(on.resolved_ms) - history.tasks[0].scheduled_ms
    assert abs(makespan - recorded_.makespan_ms) <= TOLERANCE * recorded_.makespan_ms
    # Off: every task runs (a failing one fails), on the workers the history saw.
    assert all(s in (State.COMPLETED, State.FAILED) for s in off.state), off.state
    assert all(worked > 0 for worked in off.worked_ms)
    assert set(history.sized.values()) == {"history"}
    assert all(level == 1 for curve in history.curves.values() for _, level in curve[:1])
    assert dict(history.workers) == dict.fromkeys(history.workers, 1)


def test_the_same_runs_read_from_their_pulse_messages() -> None:
    """The messages ``coalescer listen`` applied, with the recording's links and findings,
    give the same tasks (but the dependents never scheduled, which published nothing) the
    same fates and real runs. (They carry no dependencies: the queue's lags are the task
    group's to tell.)"""
    for name in HISTORIES:
        answers = recorded.Answers.load(HERE / f"{name}.json")
        _, evidence, _ = recorded.replaying(answers)
        lines = (HERE / f"{name}.events.jsonl").read_bytes().splitlines()
        assert answers.prefix is not None
        events = sources.from_events(
            sources.read_events(lines), prefix=answers.prefix, rank_tag=None, evidence=evidence
        )
        grouped = read(name)

        def fates(h: History) -> dict[str, tuple[str, bool, tuple[tuple[int, int], ...]]]:
            return {t.task_id: (t.superseded_by, bool(t.cascaded_ms), t.real_runs) for t in h.tasks}

        expected = {t: f for t, f in fates(grouped).items() if any(f)}
        assert fates(events) == expected, name
        assert events.unchecked == 0 and events.workers == grouped.workers


def test_the_queue_s_lags_are_read_from_the_history() -> None:
    """The resolver made each test pending 0.6-4.3 s after its build completed (it polls
    every 5 s): each dependent waits its own gap in the replay. A task that became pending
    while its worker waited in ``claimWork`` was claimed up to a second later (the queue
    polls its pending tasks every second for a waiting worker); one pending when its worker
    freed, in tens of milliseconds."""
    history = read("shim")
    gaps = sorted(t.lag_ms for t in history.tasks if t.lag_ms is not None)
    assert len(gaps) == 4 and 0 < gaps[0] < 1000 and 4000 < gaps[-1] < 5000
    assert gaps[1] <= history.resolver_lag_ms <= gaps[2]  # their median, for the others
    waits = sorted(t.wait_ms for t in history.tasks if t.wait_ms is not None)
    assert waits[0] < 100 and 500 < waits[-1] < 1000
    assert 500 < history.claim_wait_ms < 1000  # the median of the waits in claimWork
    assert 0 < history.hold_ms < 200  # asking the service, claiming what it held
    # Without them, the replays fall outside: the shim's build worker frees 0.2 s early and
    # runs an older push than the one it really ran; the enforcer's confirmation run of the
    # failed primary waited a second for the worker's poll.
    config, _ = HISTORIES["shim"]
    bare = without_lags(history)
    [on] = run(bare, config)
    assert final(replayed(bare, on)) != final(happened(bare))
    history = read("enforcer-bisect")
    assert 500 < history.claim_wait_ms < 1000
    config, _ = HISTORIES["enforcer-bisect"]
    bare = without_lags(history)
    [on] = run(bare, config)
    recorded_ = bare.recorded()
    assert recorded_ is not None
    makespan = max(on.resolved_ms) - bare.tasks[0].scheduled_ms
    assert makespan < (1 - TOLERANCE) * recorded_.makespan_ms


COMMAND = (sys.executable, "-m", "coalescer.cli", "replay", "--json")


def test_the_command_replays_a_recorded_history() -> None:
    done = subprocess.run(
        [*COMMAND, "--config", "on-claim", "--recorded", str(HERE / "late-pool.json")],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("COALESCER_")},
    )
    assert done.returncode == 0, done.stderr
    doc = orjson.loads(done.stdout)
    history = doc["history"]
    assert history["source"] == "recorded history (late-pool.json)"
    assert history["recorded"] | {"workerHours": 0} == {
        "workerHours": 0,
        "run": 2,
        "superseded": 8,
        "cascaded": 0,
        "canceled": 0,
        "makespanHours": history["recordedMakespanHours"],
    }
    assert {p["sizedBy"] for p in history["pools"].values()} == {"history"}
    off, on = doc["configurations"]
    assert (off["run"], on["run"], on["superseded"]) == (10, 2, 8)


def figures() -> None:
    """Print how far each history's replay is from what happened, with the queue's lags as
    the model reads them and without (one median resolver lag, no claim wait, no hold): the
    figures of the model page's honesty check."""
    print("history          fates  worker time  makespan | without the lags: fates  makespan")
    for name, (config, _) in HISTORIES.items():
        history = read(name)
        seen = history.recorded()
        assert seen is not None
        found = []
        for h in (history, without_lags(history)):
            [on] = run(h, config)
            makespan = max(on.resolved_ms) - h.tasks[0].scheduled_ms
            same = "same" if final(replayed(h, on)) == final(happened(h)) else "DIFFER"
            found.append((same, on.worker_ms / seen.worker_ms - 1, makespan / seen.makespan_ms - 1))
        (fates, time, span), (bare_fates, _, bare_span) = found
        print(
            f"{name:16} {fates:6} {time:+11.1%} {span:+9.1%} | {bare_fates:>23} {bare_span:+9.1%}"
        )


if __name__ == "__main__":
    figures()


def test_a_file_that_is_not_a_recorded_history_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "history.json"
    for text, says in (
        ("[]", "not a recorded history"),
        ('{"format": "other"}', "not a recorded history"),
        ('{"format": "coalescer-history/1", "links": [{"runId": 0}]}', "bad entry"),
        ("{", "unexpected"),
    ):
        path.write_text(text)
        with pytest.raises(InvalidInput, match=says):
            recorded.Answers.load(path)
