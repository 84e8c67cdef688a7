"""The pool model with superseding, through the real index on real Redis: a worker runs the
newest task its answer lists and supersedes the others; thresholds hold it back; what the
shim refuses is not claimed; and, on small random histories, nobody is superseded by an older
task and no task is lost."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from coalescer.errors import ConfigError
from coalescer.replay.history import History
from coalescer.replay.metrics import summarize
from coalescer.replay.pool import REPLACED, RESOLVED, Outcome, State
from coalescer.replay.runner import Config, replay
from coalescer.store import open_store
from coalescer.store.replay import holds_nothing
from tests.conftest import REDIS_URL
from tests.replay.support import history, minutes, task

pytestmark = pytest.mark.integration


def run(h: History, *configs: Config) -> list[Outcome]:
    async def go() -> list[Outcome]:
        store = await open_store(REDIS_URL, grace_seconds=3600)
        try:
            outcomes = await replay(h, configs, store)
            assert await holds_nothing(store)  # each configuration's namespace is dropped
            return outcomes
        finally:
            await store.close()

    return asyncio.run(go())


def states(h: History, out: Outcome) -> dict[str, str]:
    return {t.task_id: out.state[i].name.lower() for i, t in enumerate(h.tasks)}


BACKLOG = (
    task("busy", 0, 60, key=None),
    task("a", 1, 10),
    task("b", 2, 10),
    task("c", 3, 10),
    task("d", 4, 10, key="other"),
)


def test_the_worker_runs_the_newest_listed_task_and_supersedes_the_others() -> None:
    h = history(*BACKLOG)
    off, on = run(h, Config(False), Config(True))
    assert set(states(h, off).values()) == {"completed"}
    assert states(h, on) == {
        "busy": "completed",
        "a": "superseded",
        "b": "superseded",
        "c": "completed",
        "d": "completed",
    }
    c = [t.task_id for t in h.tasks].index("c")
    assert [on.by[i] for i in range(len(h.tasks)) if on.state[i] == State.SUPERSEDED] == [c, c]
    # a was claimed first, at 60; c ran on that claim and both secondaries resolved with it.
    assert minutes(on.resolved_ms[c]) == 70
    assert on.worker_ms == off.worker_ms - 20 * 60_000


def test_two_workers_claiming_one_key_at_the_same_moment_each_run_a_task_of_it() -> None:
    # Both workers are busy until minute 60, then free together: each gets a task from the
    # queue at once (a, then b), and only then does each ask. a's worker holds c, the newest
    # still pending, and runs it; b's worker finds b alone.
    h = history(
        task("busy1", 0, 60, key=None),
        task("busy2", 0, 60, key=None),
        task("a", 1, 10),
        task("b", 2, 10),
        task("c", 3, 10),
        workers=2,
    )
    (on,) = run(h, Config(True))
    assert states(h, on) == {
        "busy1": "completed",
        "busy2": "completed",
        "a": "superseded",
        "b": "completed",
        "c": "completed",
    }
    ids = [t.task_id for t in h.tasks]
    assert on.by[ids.index("a")] == ids.index("c") and on.asked == 2
    assert [minutes(on.left_ms[ids.index(t)]) for t in ("a", "b", "c")] == [60, 60, 60]


def test_a_task_given_back_runs_itself_as_the_shim_has_it() -> None:
    # c, run for a and b, is canceled at 65: its worker gives a and b back. Each then runs
    # itself: a, claimed first, claims nothing newer, and nobody holds b as a secondary.
    h = history(
        task("busy", 0, 60, key=None),
        task("a", 1, 10),
        task("b", 2, 10),
        task("c", 3, 10, canceled=65),
    )
    (on,) = run(h, Config(True))
    assert states(h, on) == {
        "busy": "completed",
        "a": "completed",
        "b": "completed",
        "c": "withdrawn",
    }
    ids = [t.task_id for t in h.tasks]
    assert [on.runs[ids.index(t)] for t in ("a", "b")] == [2, 2] and on.released == 2
    assert [minutes(on.resolved_ms[ids.index(t)]) for t in ("a", "b")] == [75, 85]


def test_latest_wins_supersedes_on_arrival_through_the_policy_decisions() -> None:
    h = history(*BACKLOG)
    (out,) = run(h, Config(True, strategy="latest-wins"))
    assert states(h, out) == {
        "busy": "completed",
        "a": "superseded",
        "b": "superseded",
        "c": "completed",
        "d": "completed",
    }
    ids = [t.task_id for t in h.tasks]
    # Each older task went as the next one arrived: a chain a → b → c.
    assert [ids[out.by[ids.index(v)]] for v in ("a", "b")] == ["b", "c"]
    assert [minutes(out.resolved_ms[ids.index(v)]) for v in ("a", "b")] == [2, 3]
    assert out.missed == 0


def test_first_wins_keeps_the_oldest_and_supersedes_later_duplicates_on_arrival() -> None:
    h = history(*BACKLOG)
    (out,) = run(h, Config(True, strategy="first-wins"))
    assert states(h, out) == {
        "busy": "completed",
        "a": "completed",
        "b": "superseded",
        "c": "superseded",
        "d": "completed",
    }
    ids = [t.task_id for t in h.tasks]
    assert [ids[out.by[ids.index(v)]] for v in ("b", "c")] == ["a", "a"]
    assert [minutes(out.resolved_ms[ids.index(v)]) for v in ("b", "c")] == [2, 3]
    report = summarize(h, "first-wins", out, None, newest_wins=False)
    assert (report.wrong_winners, report.lost, report.asked) == (0, 0, 0)
    assert summarize(h, "first-wins", out, None).wrong_winners == 2  # not by newer tasks


def test_a_policy_refuses_a_database_that_holds_anything() -> None:
    async def go() -> None:
        store = await open_store(REDIS_URL, grace_seconds=3600)
        try:
            await store.count({"unrelated": 1})
            with pytest.raises(ConfigError, match="empty Redis database"):
                await replay(history(*BACKLOG), [Config(True, strategy="latest-wins")], store)
            assert await replay(history(*BACKLOG), [Config(True)], store)  # on claim is fine
        finally:
            await store.client.flushdb()
            await store.close()

    asyncio.run(go())


def test_thresholds_hold_superseding_back_until_exceeded() -> None:
    h = history(*BACKLOG)
    # When a is claimed (minute 60), b and c are pending, b since minute 2; when b is claimed
    # (minute 70, if a ran alone), c is pending alone, since minute 3.
    size_met, size_unmet, age_met, age_unmet = run(
        h,
        Config(True, size=1),
        Config(True, size=2),
        Config(True, age=57 * 60),
        Config(True, age=67 * 60),
    )
    assert states(h, size_met)["a"] == "superseded"
    assert states(h, age_met)["a"] == "superseded"
    assert "superseded" not in states(h, size_unmet).values()
    assert "superseded" not in states(h, age_unmet).values()


def test_tasks_of_another_task_queue_are_not_claimed() -> None:
    h = history(
        task("busy", 0, 60, key=None), task("a", 1, 10), task("b", 2, 10, queue="elsewhere")
    )
    (on,) = run(h, Config(True))
    assert states(h, on) == {"busy": "completed", "a": "completed", "b": "completed"}


def test_dependents_of_a_superseded_task_are_never_scheduled() -> None:
    h = history(
        task("busy", 0, 60, key=None, queue="build"),
        task("build1", 1, 10, queue="build"),
        task("build2", 2, 10, queue="build"),
        task("test1", 1, 5, key="t", queue="test", after=("build1",)),
        task("test2", 2, 5, key="t", queue="test", after=("build2",)),
    )
    off, on = run(h, Config(False), Config(True))
    assert states(h, on)["test1"] == "waiting"
    report = summarize(h, "on", on, off.worker_ms / 3_600_000)
    assert (report.superseded, report.never_scheduled, report.lost, report.wrong_winners) == (
        1,
        1,
        0,
        0,
    )
    build_key = next(k for k in report.keys if k.key == "k")
    assert build_key.no_own_result == 1 and build_key.no_result == 0


@st.composite
def histories(draw: st.DrawFn) -> History:
    """Up to 14 tasks on two queues and two keys, some sharing an order, some dependent."""
    n = draw(st.integers(1, 14))
    tasks = []
    for i in range(n):
        deps = (
            draw(st.lists(st.sampled_from([f"t{j}" for j in range(i)]), max_size=2, unique=True))
            if i
            else []
        )
        tasks.append(
            task(
                f"t{i}",
                draw(st.integers(0, 30)),
                draw(st.one_of(st.none(), st.integers(1, 40))) if i else 5,
                key=draw(st.sampled_from(["k1", "k2", None])),
                queue=draw(st.sampled_from(["q1", "q2"])),
                order=draw(st.integers(0, 5)),
                priority=draw(st.integers(0, 2)),
                after=tuple(deps),
                outcome=draw(st.sampled_from(["completed", "completed", "failed"])),
                canceled=draw(st.one_of(st.none(), st.none(), st.integers(0, 60))),
            )
        )
    workers = draw(st.integers(1, 3))
    return History.build(tasks, workers={"q1": workers, "q2": workers})


def check(h: History, out: Outcome, config: Config) -> None:
    report = summarize(h, config.name, out, None, rule_of=config.rule_for)
    assert report.wrong_winners == 0
    assert report.lost == 0
    for i, s in enumerate(out.state):
        assert s in RESOLVED or (s == State.WAITING and out.pending_ms[i] == -1)
        if s in REPLACED:
            mine, theirs = h.tasks[i], h.tasks[out.by[i]]
            newer = (theirs.order, theirs.task_id) > (mine.order, mine.task_id)
            if config.rule_for(mine).strategy != "first-wins":
                assert newer
            elif newer:  # first-wins keeps a running task, even a newer one
                assert out.left_ms[out.by[i]] <= out.resolved_ms[i] <= out.resolved_ms[out.by[i]]
            assert set(mine.keys) & set(theirs.keys)
            if not config.on_arrival:  # the worker's primary ran, on the same queue, keys
                assert out.state[out.by[i]] in (State.COMPLETED, State.FAILED)
                assert mine.task_queue == theirs.task_queue and mine.keys == theirs.keys
                assert out.resolved_ms[i] == out.resolved_ms[out.by[i]]
    if not config.supersede:
        assert State.SUPERSEDED not in out.state
    assert (
        report.run
        + report.superseded
        + report.deadline_exceeded
        + report.never_scheduled
        + report.withdrawn
        == len(h.tasks)
    )
    for i, s in enumerate(out.state):  # canceled as recorded, at the recorded time only
        if s == State.WITHDRAWN:
            assert out.resolved_ms[i] == h.tasks[i].canceled_ms


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(h=histories(), size=st.sampled_from([None, 0, 1, 2]), age=st.sampled_from([None, 0, 600]))
def test_no_wrong_winner_and_no_lost_task_on_random_histories(
    h: History, size: int | None, age: int | None
) -> None:
    configs: Sequence[Config] = (
        Config(False),
        Config(True),
        Config(True, age=age, size=size),
        Config(True, age=age, size=size, strategy="latest-wins"),
        Config(True, age=age, size=size, strategy="first-wins"),
    )
    for config, out in zip(configs, run(h, *configs), strict=True):
        check(h, out, config)
