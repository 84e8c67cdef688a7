"""Replays of runs recorded end to end with superseding on (:mod:`tests.replay.live`): worker
shims superseding on claim, on a current queue (secondaries canceled, or completed when asked
for by name) and on an old one (``exception/superseded``); and the enforcer under a policy
file, with shims asking on claim for the key no rule decides.

Read back from the queue (``--task-group``) or from the queue's messages (``--events``), the
history replayed ``off`` runs every task on the pool that really ran (a superseded task for a
duration drawn from its key's real runs, its dependents scheduled); the configuration that was
on reproduces what happened: the same tasks run, superseded (by the same final primary) and
never scheduled, and the worker time and makespan within :data:`TOLERANCE`, the model page's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from coalescer.emulator.clock import Clock
from coalescer.emulator.harness import TEST_OPTIONS, QueueEmulator
from coalescer.ingest.events import Message
from coalescer.policy.rules import Policy, loads
from coalescer.replay import sources
from coalescer.replay.history import History
from coalescer.replay.links import Evidence
from coalescer.replay.pool import Outcome, State
from coalescer.replay.runner import Config, replay
from coalescer.store import Store, open_store
from coalescer.worker.protocol import SupersedeAs
from tests.replay.live import PREFIX, LiveRun, Push, served

pytestmark = pytest.mark.integration

#: The model page's tolerance on worker time and makespan.
TOLERANCE = 0.01

PUSHES = (
    Push(0, build=300, test=120, mac=240),
    Push(60, build=300, test=120, mac=180),
    Push(120, build=300, test=120, mac=200),
    Push(180, build=300, test=120, mac=200),
    Push(240, build=300, test=120, mac=200),
)
#: Two mac workers: both are free at 240 s, claim the oldest two mac tasks at once and ask.
SHIM_WORKERS = {"proj/build": 1, "proj/test": 1, "proj/mac": 2}
#: What the shims do with these pushes. The build worker, busy with b0 until 300 s, then
#: claims b1 and runs b4, the newest, superseding b1-b3, whose tests are never scheduled. Both
#: mac workers claim at 240 s, m2 and m3; m2's worker asks first, holds m4 too and runs it;
#: m3's worker finds its task alone and runs it: two of one key run side by side.
BY_SHIMS = {
    "b0": "ran",
    "t0": "ran",
    "m0": "ran",
    "b1": "superseded by b4",
    "t1": "never scheduled",
    "m1": "ran",
    "b2": "superseded by b4",
    "t2": "never scheduled",
    "m2": "superseded by m4",
    "b3": "superseded by b4",
    "t3": "never scheduled",
    "m3": "ran",
    "b4": "ran",
    "t4": "ran",
    "m4": "ran",
}
ENDED_AS = {
    # A current queue: canceled (auto), or completed when asked for by name.
    (False, SupersedeAs.AUTO): ("exception", "canceled"),
    (False, SupersedeAs.COMPLETED): ("completed", "completed"),
    # An old queue: exception/superseded.
    (True, SupersedeAs.AUTO): ("exception", "superseded"),
}

POLICY = """\
rules:
  - name: builds
    keys: build
    strategy: latest-wins
  - name: mac
    keys: mac
    strategy: latest-wins
    supersede-running: true
"""
POLICY_WORKERS = {"proj/build": 1, "proj/test": 1, "proj/mac": 1}
#: Under the policy: each build pending behind b0 is superseded as the next arrives, and the
#: enforcer cancels its test (cascade); each mac task is canceled while it runs, as the next
#: arrives. Each superseded-by.json names the primary as it was when the enforcer acted.
BY_ENFORCER = {
    "b0": "ran",
    "t0": "ran",
    "m0": "superseded by m1",
    # The enforcer names the end of the chain in the earlier victims' superseded-by.json once
    # their primary is superseded in turn (b2 by b3, b3 by b4).
    "b1": "superseded by b4",
    "t1": "never scheduled",
    "m1": "superseded by m2",
    "b2": "superseded by b4",
    "t2": "never scheduled",
    "m2": "superseded by m3",
    "b3": "superseded by b4",
    "t3": "never scheduled",
    "m3": "superseded by m4",
    "b4": "ran",
    "t4": "ran",
    "m4": "ran",
}


def emulator(legacy: bool) -> QueueEmulator:
    """An emulator whose clock stands still between the run's steps (exact recorded times)."""
    options = dataclasses.replace(TEST_OPTIONS, legacy=legacy, claim_work_timeout=0.0)
    return QueueEmulator(options, clock=Clock(frozen=True))


@pytest.fixture
def em() -> Iterator[QueueEmulator]:
    with emulator(legacy=False) as started:
        yield started


async def run_replay(history: History, *configs: Config) -> list[Outcome]:
    scratch = await open_store(None, grace_seconds=3600)
    try:
        return await replay(history, configs, scratch)
    finally:
        await scratch.close()


class Names:
    """Readable names for a run's tasks: b0, t0, m0, b1, ... in creation order."""

    def __init__(self, live: LiveRun) -> None:
        self.of = {t: "btm"[n % 3] + str(n // 3) for n, t in enumerate(live.task_ids)}

    def say(self, results: dict[str, str]) -> dict[str, str]:
        return {
            self.of[task_id]: " ".join(self.of.get(word, word) for word in what.split())
            for task_id, what in results.items()
        }


def replayed(history: History, out: Outcome) -> dict[str, str]:
    """Each task as :meth:`LiveRun.outcome` says it of the real run."""
    found = {}
    for i, task in enumerate(history.tasks):
        state = out.state[i]
        if state in (State.COMPLETED, State.FAILED):
            found[task.task_id] = "ran"
        elif state in (State.SUPERSEDED, State.CANCELED):
            found[task.task_id] = "superseded by " + history.tasks[out.by[i]].task_id
        elif state == State.WAITING:
            found[task.task_id] = "never scheduled"
        else:
            found[task.task_id] = state.name.lower()
    return found


def final(results: dict[str, str]) -> dict[str, str]:
    """Each task's final primary: the end of its chain of superseded-by links."""
    out = {}
    for task, what in results.items():
        seen = {task}
        while what.startswith("superseded by ") and (by := what.split()[-1]) not in seen:
            seen.add(by)
            if not results[by].startswith("superseded by "):
                break
            what = results[by]
        out[task] = what
    return out


def check_off(history: History, off: Outcome, workers: dict[str, int]) -> None:
    """Every task runs, on the pool that really ran; what never did its work runs for a
    duration one of its key's real runs took."""
    assert dict(history.workers) == workers
    assert all(state == State.COMPLETED for state in off.state), off.state
    real: dict[str, set[int]] = {}
    for task in history.tasks:
        if task.duration_ms is not None:
            real.setdefault(task.keys[0], set()).add(task.duration_ms)
    for i, task in enumerate(history.tasks):
        assert off.worked_ms[i] in real[task.keys[0]]


def check_reproduced(history: History, out: Outcome, lived: dict[str, str]) -> None:
    """The configuration that was on: the same fates (of the tasks in ``lived``), the real
    worker time and makespan."""
    fates = final(replayed(history, out))
    assert {t: fates[t] for t in lived} == final(lived)
    recorded = history.recorded()
    assert recorded is not None
    assert abs(out.worker_ms - recorded.worker_ms) <= TOLERANCE * recorded.worker_ms
    makespan = max(out.resolved_ms) - history.tasks[0].scheduled_ms
    assert abs(makespan - recorded.makespan_ms) <= TOLERANCE * recorded.makespan_ms


async def record(
    em: QueueEmulator,
    store: Store,
    *,
    supersede_as: SupersedeAs = SupersedeAs.AUTO,
    policy: Policy | None = None,
) -> tuple[LiveRun, str, History, History]:
    """Run the pushes; the run, its task group, and the history read back as a task group and
    as its events (their links read from the service's lineage, while it still serves)."""
    workers = POLICY_WORKERS if policy else SHIM_WORKERS
    asking = ("test",) if policy else ("build", "test", "mac")
    async with served(store, policy) as service:
        live = LiveRun(
            em,
            store,
            service,
            workers=workers,
            asking=asking,
            policy=policy,
            supersede_as=supersede_as,
        )
        group = await live.run(PUSHES)
        grouped = await asyncio.to_thread(
            sources.from_task_groups, em.queue(), [group], prefix=PREFIX, rank_tag=None
        )
        events = await asyncio.to_thread(
            sources.from_events,
            [Message.from_json(m) for m in em.published],
            prefix=PREFIX,
            rank_tag=None,
            evidence=Evidence(service=service),
        )
    return live, group, grouped, events


@pytest.mark.parametrize(
    ("legacy", "supersede_as"), list(ENDED_AS), ids=["canceled", "completed", "old-queue"]
)
async def test_a_run_superseded_by_worker_shims_replays_off_and_on_claim(
    store: Store, legacy: bool, supersede_as: SupersedeAs
) -> None:
    with emulator(legacy) as em:
        live, _, history, _ = await record(em, store, supersede_as=supersede_as)
        names = Names(live)
        lived = live.outcome()
        queue = em.queue()
        secondaries = [t for t, what in names.say(lived).items() if what.startswith("superseded")]
        for task_id, name in names.of.items():
            if name in secondaries:
                [run] = queue.status(task_id)["status"]["runs"]
                assert (run["state"], run["reasonResolved"]) == ENDED_AS[legacy, supersede_as]
    expected = dict(BY_SHIMS)
    if supersede_as is SupersedeAs.COMPLETED:
        # Completed builds scheduled their tests, all four at one instant (b1-b3 resolved with
        # b4): the test worker ran the newest, by taskId, as the index orders ties.
        tests = sorted(("t1", "t2", "t3", "t4"), key={n: t for t, n in names.of.items()}.get)
        expected |= {n: f"superseded by {tests[-1]}" for n in tests[:-1]} | {tests[-1]: "ran"}
    assert names.say(lived) == expected

    tasks = {names.of[t.task_id]: t for t in history.tasks}
    superseded = {n: names.of[t.superseded_by] for n, t in tasks.items() if t.superseded_ms}
    assert superseded == {
        n: what.split()[-1] for n, what in expected.items() if what.startswith("superseded")
    }
    assert not any(t.canceled_ms or t.cascaded_ms for t in history.tasks)
    assert all(tasks[n].duration_ms is None for n in superseded)

    off, on = await run_replay(history, Config(False), Config(True))
    check_off(history, off, SHIM_WORKERS)
    if supersede_as is SupersedeAs.COMPLETED:
        # A completed secondary schedules its dependents; the model's superseded task never
        # does (see the model's limits): the tests of b1-b3 are never scheduled instead, and
        # the same tasks run.
        # Two tests ran in both, for the same time.
        expected |= {f"t{n}": "never scheduled" for n in (1, 2, 3)} | {"t4": "ran"}
        lived = {t: what for t, what in lived.items() if not names.of[t].startswith("t")}
    assert names.say(replayed(history, on)) == expected
    check_reproduced(history, on, lived)


async def test_the_same_run_read_from_its_events(em: QueueEmulator, store: Store) -> None:
    _, _, grouped, _ = await record(em, store)
    messages = [Message.from_json(m) for m in em.published]
    # Read with the queue, each canceled run's superseded-by.json tells it superseded.
    events = await asyncio.to_thread(
        sources.from_events,
        messages,
        prefix=PREFIX,
        rank_tag=None,
        evidence=Evidence(queue=em.queue()),
    )
    fates = {t.task_id: (t.superseded_by, t.real_runs, t.duration_ms) for t in grouped.tasks}
    assert {t.task_id: (t.superseded_by, t.real_runs, t.duration_ms) for t in events.tasks} == {
        task_id: fate for task_id, fate in fates.items() if fate[1] or fate[0]
    }  # the tests never scheduled published nothing
    assert events.workers == grouped.workers == SHIM_WORKERS and events.unchecked == 0
    # Without the queue, nothing tells the worker's cancels from a person's, nor its
    # primaries from secondaries it might have completed: said, as 4 + 2 runs unchecked. The
    # pools are right all the same: a run canceled beside another of its key ran nothing.
    blind = sources.from_events(messages, prefix=PREFIX, rank_tag=None)
    assert blind.unchecked == 6
    assert sum(1 for t in blind.tasks if t.canceled_ms) == 4
    assert blind.workers == SHIM_WORKERS


async def test_a_run_under_the_enforcer_replays_off_and_under_its_policy(
    em: QueueEmulator, store: Store
) -> None:
    policy = loads(POLICY, "policy.yaml", toml=False)
    live, _, history, events = await record(em, store, policy=policy)
    names = Names(live)
    lived = live.outcome()
    assert names.say(lived) == BY_ENFORCER
    queue = em.queue()
    for task_id, name in names.of.items():
        [run] = queue.status(task_id)["status"]["runs"]
        if name in ("b1", "b2", "b3"):  # claimed by the enforcer, then canceled
            assert (run["workerGroup"], run["workerId"], run["reasonResolved"]) == (
                "coalescer",
                "enforcer",
                "canceled",
            )
        elif name in ("m0", "m1", "m2", "m3"):  # canceled on its worker, as it ran
            assert (run["workerGroup"], run["reasonResolved"]) == ("live", "canceled")
        elif name in ("t1", "t2", "t3"):  # canceled before it was ever scheduled
            assert ("started" not in run, run["reasonResolved"]) == (True, "canceled")

    config = Config.from_policy(policy, "policy.yaml")
    for read in (history, events):  # from the queue, and from the events and the lineage
        tasks = {names.of[t.task_id]: t for t in read.tasks}
        assert {n for n, t in tasks.items() if t.superseded_ms} == {
            "b1",
            "b2",
            "b3",
            "m0",
            "m1",
            "m2",
            "m3",
        }
        assert {n: names.of[t.dependencies[0]] for n, t in tasks.items() if t.cascaded_ms} == {
            "t1": "b1",
            "t2": "b2",
            "t3": "b3",
        }
        assert not any(t.canceled_ms for t in read.tasks)
        # The mac runs the enforcer canceled ran until then: each took the one mac worker.
        assert [len(tasks[f"m{n}"].real_runs) for n in range(5)] == [1] * 5
        off, under = await run_replay(read, Config(False), config)
        check_off(read, off, POLICY_WORKERS)
        check_reproduced(read, under, lived)


def command(*args: str, root_url: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TASKCLUSTER_", "COALESCER_"))}
    env.pop("REDIS_URL", None)
    if root_url is not None:
        env["TASKCLUSTER_ROOT_URL"] = root_url
    return subprocess.run(
        [sys.executable, "-m", "coalescer.cli", "replay", "--json", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def figures(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert done.returncode == 0, done.stderr
    doc = orjson.loads(done.stdout)
    return {"history": doc["history"]} | {c["name"]: c for c in doc["configurations"]}


async def test_the_command_reads_a_task_group_or_its_events_as_they_happened(
    em: QueueEmulator, store: Store, tmp_path: Path
) -> None:
    _, group, history, _ = await record(em, store)
    recorded = history.recorded()
    assert recorded is not None
    events = tmp_path / "events.jsonl"
    events.write_bytes(b"".join(orjson.dumps(m) + b"\n" for m in em.published))
    runs = [
        ("--task-group", group, "--config", "on-claim"),
        ("--events", str(events), "--config", "on-claim"),
    ]
    for args in runs:
        done = await asyncio.to_thread(command, *args, root_url=em.root_url)
        assert "may have been superseded" not in done.stderr
        found = figures(done)
        tasks = 15 if args[0] == "--task-group" else 12  # unscheduled tests publish nothing
        assert found["history"]["workers"] == SHIM_WORKERS
        assert found["history"]["recorded"] == recorded.to_json() | {
            "cascaded": 0,
            "canceled": 0,
            "run": 8,
            "superseded": 4,
        }
        off, on = found["off"], found["on-claim always"]
        assert (off["run"], off["withdrawn"], off["never_scheduled"]) == (tasks, 0, 0)
        assert (on["run"], on["superseded"], on["withdrawn"]) == (8, 4, 0)
        assert on["worker_hours"] == pytest.approx(recorded.worker_ms / 3_600_000, abs=0.001)
    # Without the queue, the worker's cancels cannot be told from a person's: it says so.
    done = await asyncio.to_thread(command, "--events", str(events))
    assert "6 recorded runs (canceled, or completed while" in done.stderr
    assert figures(done)["history"]["uncheckedRuns"] == 6


async def test_the_command_reads_the_enforcer_s_lineage_from_the_service(
    em: QueueEmulator, store: Store, tmp_path: Path
) -> None:
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(POLICY)
    policy = loads(POLICY, "policy.yaml", toml=False)
    events = tmp_path / "events.jsonl"
    async with served(store, policy) as service:
        live = LiveRun(em, store, service, workers=POLICY_WORKERS, asking=("test",), policy=policy)
        await live.run(PUSHES)
        events.write_bytes(b"".join(orjson.dumps(m) + b"\n" for m in em.published))
        args = ("--events", str(events), "--policy", str(policy_file))
        blind = figures(await asyncio.to_thread(command, *args))
        found = figures(await asyncio.to_thread(command, *args, "--service", service))
    # The enforcer's cancels of running mac tasks, and its cascade, are the lineage's to tell.
    assert (blind["off"]["withdrawn"], blind["history"]["uncheckedRuns"]) == (7, 7)
    assert found["history"]["uncheckedRuns"] == 0
    assert found["history"]["workers"] == POLICY_WORKERS
    assert found["history"]["recorded"]["superseded"] == 7
    assert found["history"]["recorded"]["cascaded"] == 3
    off, under = found["off"], found["policy policy.yaml"]
    assert (off["run"], off["withdrawn"], off["never_scheduled"]) == (15, 0, 0)
    assert (under["run"], under["superseded"], under["never_scheduled"]) == (5, 7, 3)


async def test_a_task_group_saved_replays_the_same_without_the_queue(
    em: QueueEmulator, store: Store, tmp_path: Path
) -> None:
    _, group, _, _ = await record(em, store)
    saved = tmp_path / "history.json"
    args = ("--config", "on-claim")
    read = await asyncio.to_thread(
        command, "--task-group", group, "--save", str(saved), *args, root_url=em.root_url
    )
    again = await asyncio.to_thread(command, "--recorded", str(saved), *args)
    live, offline = figures(read), figures(again)
    assert offline["history"]["source"] == "recorded history (history.json)"
    for doc in (live, offline):
        doc["history"].pop("source")
    assert offline == live
    assert len(saved.read_bytes()) < 20_000  # what the replay reads, no task's payload
