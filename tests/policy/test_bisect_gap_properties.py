"""Property of the enforcer's search over the gap: whichever pushes between the newest that
passed and the failed primary were canceled earlier (running when a newer push arrived, under
``supersede-running``) and whichever the primary held, wherever the first failing push is, and
however many runs go at once, the search names that push (the newest that passed as its last
good when no push of the search passed below it), runs every canceled push it probes again
(``rerunTask``), supersedes the held pushes nothing needed by the run that stands for them,
gives the canceled pushes back to their key's decisions (``ran``), and leaves nothing held,
searched or to do. Each event reaches the index twice, the second time after everything else:
nothing changes, and no second search starts.

The decisions and the search are the real ones on real Redis; the queue is
:class:`tests.policy.test_bisect_properties.Queue` with cancellation and reruns of a canceled
task (the same on the emulator: tests/policy/test_bisect_gap.py)."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, event, given, settings

from coalescer.policy.actions import Result
from coalescer.policy.enforcer import Enforcer
from coalescer.store import bisections, open_store
from coalescer.store import lineage as records
from coalescer.store import policy as outbox
from coalescer.store.policy import Entry
from tests.conftest import REDIS_URL
from tests.policy.support import rule
from tests.policy.test_bisect_properties import Queue

pytestmark = pytest.mark.integration


class CancelingQueue(Queue):
    """:class:`Queue` where a running victim is canceled, and a canceled task runs again."""

    def claim(self, task_id: str) -> None:
        self._set(task_id, "running", "running")

    async def cancel(self, entry: Entry) -> Result:
        if self.state(entry.victim) != "running":
            return Result("gone")
        self._set(entry.victim, "canceled", "exception", "canceled")
        return Result("canceled", saved="running", started_ms=self.now)

    async def rerun(self, task_id: str, after_run: int) -> Result:
        runs = self.runs[task_id]
        if len(runs) - 1 == after_run and runs[-1] == "canceled":
            self.reruns.append(task_id)
            self._new_run(task_id)
            return Result("rerun")
        return await super().rerun(task_id, after_run)


async def gap_search(canceled: frozenset[int], m: int, culprit: int, parallel: int) -> None:
    """Push 0 passes; pushes ``1 .. m - 1`` arrive one after another, those in ``canceled``
    claimed by a worker before the next arrives (then canceled for it), the others left
    pending (held for the newest); push ``m``, the primary, runs and fails. Pushes ``culprit``
    and on are broken."""
    key = f"gap.{uuid.uuid4().hex[:12]}"
    policy = rule(
        key,
        strategy="latest-wins",
        supersede_running=True,
        on_primary_failure="bisect",
        bisect_confirm=0,
        bisect_parallel=parallel,
    )
    queue = CancelingQueue(key)
    pushes = [f"T{i:02d}{uuid.uuid4().hex[:18]}" for i in range(m + 1)]
    store = await open_store(REDIS_URL, grace_seconds=3600)
    await store.index_state(queue.now)  # the index knows every task from here, as in service
    enforcer = Enforcer(
        store,
        queue,
        consumer="prop",
        tick=3600.0,
        clock=lambda: datetime.fromtimestamp(queue.now / 1000, UTC),
    )
    delivered = []

    async def settle(work: bool = True) -> None:
        for _ in range(300):
            events, queue.events = queue.events, []
            delivered.extend(events)
            if events:
                await store.apply(events, now_ms=queue.now, policy=policy)
            done = await enforcer.round()
            pending = [t for t in pushes if work and queue.state(t) == "pending"]
            for task_id in pending:
                queue.run(task_id, passes=pushes.index(task_id) < culprit)
            if not (events or done or pending or queue.events):
                return
        raise AssertionError("the search did not end")

    try:
        queue.create(pushes[0], 0.0)
        queue.run(pushes[0], passes=True)
        for i in range(1, m + 1):
            queue.create(pushes[i], float(i))
            await settle(work=False)
            if i in canceled:
                queue.claim(pushes[i])
                await settle(work=False)
        queue.run(pushes[m], passes=False)
        await settle()

        [finding] = await bisections.for_task(store, [key], pushes[m])
        runs = {r["taskId"]: r["runId"] for r in finding["runs"]}
        named = pushes[culprit]
        assert finding["verdict"] == "culprit"
        assert finding["culprit"] == {"taskId": named, "runId": runs.get(named, 0)}
        good = pushes[culprit - 1]
        assert finding["lastGood"]["taskId"] == good
        assert (finding["gap"], finding["held"]) == (len(canceled), m - 1 - len(canceled))
        for i in canceled:
            task_id = pushes[i]
            decision = await records.decision(store, key, task_id)
            assert decision is not None
            ran = task_id in queue.reruns
            assert decision.state == ("ran" if ran else "canceled"), (i, decision.state)
            if ran:
                assert queue.runs[task_id][-1] == ("completed" if i < culprit else "failed")
        for i in range(1, m):
            if i not in canceled and pushes[i] not in queue.released:
                assert queue.runs[pushes[i]] == ["superseded"], (i, queue.runs[pushes[i]])
        assert (await outbox.outstanding(store, [key]))[key] == (0, 0)
        assert await outbox.searches(store, key) == {}
        event(f"canceled pushes run again: {len(queue.reruns)}")

        # Every event again, after everything else: nothing changes.
        before = {t: list(r) for t, r in queue.runs.items()}
        await store.apply(delivered, now_ms=queue.now, policy=policy)
        await settle()
        assert queue.runs == before
        assert len(await bisections.for_task(store, [key], pushes[m])) == 1
    finally:
        await store.close()


@st.composite
def gaps(draw: st.DrawFn) -> tuple[frozenset[int], int, int, int]:
    m = draw(st.integers(2, 12))
    canceled = draw(st.frozensets(st.integers(1, m - 1), max_size=m - 1))
    culprit = draw(st.integers(1, m))  # m: only the primary fails
    return canceled, m, culprit, draw(st.integers(1, 3))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=gaps())
def test_the_search_names_the_first_failing_push_of_the_whole_gap(
    case: tuple[frozenset[int], int, int, int],
) -> None:
    canceled, m, culprit, parallel = case
    event("none canceled" if not canceled else "some canceled")
    asyncio.run(gap_search(canceled, m, culprit, parallel))
