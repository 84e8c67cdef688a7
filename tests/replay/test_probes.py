"""A search the worker shim ran is read by each run's real work (the finding's order and
ends), not by the spans of the claims it held."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from coalescer.replay.history import History, TaskSpec
from coalescer.replay.links import Evidence, LinkError
from coalescer.replay.probes import apply
from coalescer.store import Store, bisections
from tests.replay.live import served
from tests.replay.recording import iso
from tests.replay.support import MIN, T0


def held(task_id: str, order: int, outcome: str = "completed") -> TaskSpec:
    """A push the worker claimed at 0 and resolved when its search ended, at 30 minutes."""
    return TaskSpec(
        task_id,
        "q",
        ("k",),
        float(order),
        T0,
        T0 + 10**8,
        duration_ms=30 * MIN,
        outcome=outcome,
        started_ms=T0,
        resolved_ms=T0 + 30 * MIN,
        real_runs=((T0, T0 + 30 * MIN),),
    )


def finding(by: str = "worker wg/w1") -> dict[str, Any]:
    # p failed at 10, its confirmation failed at 20; v1 passed at 30: p the culprit.
    runs = [("p", 10), ("p", 20), ("v1", 30)]
    return {
        "by": by,
        "runs": [{"taskId": t, "runId": 0, "ended": iso(T0 + m * MIN)} for t, m in runs],
    }


def test_each_probe_ran_from_the_end_of_the_run_before_it() -> None:
    stood_for = dataclasses.replace(
        held("v2", 2), duration_ms=None, started_ms=0, resolved_ms=0, real_runs=()
    )
    tasks = [held("v1", 1), stood_for, held("p", 3, "failed")]
    history = History.build(tasks)
    recorded = history.recorded()
    assert history.workers == {"q": 2}  # v1's claim and p's side by side
    assert recorded is not None and recorded.worker_ms == 60 * MIN  # the holds as work
    read = {t.task_id: t for t in apply(tasks, [finding()])}
    assert read["p"].real_runs == ((T0, T0 + 10 * MIN), (T0 + 10 * MIN, T0 + 20 * MIN))
    assert read["p"].duration_ms == 10 * MIN
    assert read["v1"].real_runs == ((T0 + 20 * MIN, T0 + 30 * MIN),)
    assert read["v1"].duration_ms == 10 * MIN
    assert read["v2"] == tasks[1]  # held, never run: superseded as recorded
    history = History.build(read.values())
    assert history.workers == {"q": 1}
    recorded = history.recorded()
    assert recorded is not None and recorded.worker_ms == 30 * MIN


def test_the_enforcer_s_findings_change_nothing() -> None:
    tasks = [held("v1", 1), held("p", 3, "failed")]
    assert apply(tasks, [finding(by="coalescer enforce")]) == tasks


@pytest.mark.integration
async def test_the_findings_are_read_from_the_service(store: Store) -> None:
    mine = {
        **finding(),
        "key": "k",
        "primary": {"taskId": "p", "runId": 0},
        "held": 2,
        "culprit": None,
        "lastGood": None,
        "intermittent": [],
        "standsFor": [],
        "extraRuns": 2,
        "located": iso(T0 + 30 * MIN),
    }
    other = {**mine, "key": "other", "primary": {"taskId": "q", "runId": 0}}
    for one in (mine, other):
        assert await bisections.record(store, one, T0 + 30 * MIN)
    async with served(store) as url:
        found = await asyncio.to_thread(Evidence(service=url).findings, ["k"])
        assert [f["runs"] for f in found] == [mine["runs"]]
        with pytest.raises(LinkError, match="HTTP 400"):
            await asyncio.to_thread(Evidence(service=url).findings, ["bad key!"])
