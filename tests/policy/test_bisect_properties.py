"""Property of ``coalescer enforce``'s bisection (``on-primary-failure: bisect``): whatever the
number of held victims (0..16) and wherever the first failing push is (any victim, or only the
primary), the search names that push, releases at most ``ceil(log2(n + 1))`` victims to run,
supersedes every other victim by the run that stands for it, and leaves nothing held,
searched or to do. With ``bisect-confirm`` 1, every failure the search narrows on is run again
(``rerunTask``) first, and intermittent failures (a good push's first run fails, or the
primary's own failure does not come back) are never blamed: the runs stay within
:func:`~coalescer.bisection.max_runs`, and the intermittent ones are recorded as such.

The decisions and the search are the real ones (``decide.lua``, the enforcer, its
:class:`~coalescer.policy.bisecting.Searcher`, ``settle.lua``) on real Redis; the queue is
modelled in memory (:class:`Queue`), each of its changes an event for the index, so that many
examples run in seconds (the same search on the emulator: tests/policy/test_bisect.py).

Two cases are pinned on their own: a chain of held victims deeper than nine is searched whole
(latest-wins holds each victim for the next;
:func:`test_a_chain_deeper_than_nine_is_searched_whole`), and a victim stood for by the victim
it was held for is superseded by that victim's run that passed, not its held run
(:func:`test_a_stand_in_is_named_with_the_run_that_passed`)."""

from __future__ import annotations

import asyncio
import math
import uuid
from datetime import UTC, datetime

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, event, given, settings

from coalescer.bisection import max_runs
from coalescer.model import TaskEvent
from coalescer.policy.actions import Relative, Result
from coalescer.policy.enforcer import Enforcer
from coalescer.store import Store, bisections, open_store
from coalescer.store import lineage as records
from coalescer.store import policy as outbox
from coalescer.store.policy import Entry
from tests.conftest import REDIS_URL
from tests.policy.support import rule

pytestmark = pytest.mark.integration

NOW = 1_893_456_000_000
MINUTE = 60_000
DEADLINE = NOW + 24 * 60 * MINUTE


class Queue:
    """Each task's runs (``pending``, ``held`` by the enforcer, ``running`` on a worker, or
    resolved), as the enforcer's :class:`~coalescer.policy.actions.QueueActions` see them;
    every change is an event for the index (:attr:`events`)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.now = NOW
        self.order: dict[str, float] = {}
        self.runs: dict[str, list[str]] = {}
        self.since: dict[str, int] = {}
        self.created: dict[str, int] = {}
        self.events: list[TaskEvent] = []
        self.released: list[str] = []
        self.reruns: list[str] = []
        #: Tasks moved to the front of the queue (each pending when raised).
        self.raised: list[str] = []
        self.superseded_by: dict[str, tuple[str, int]] = {}

    def create(self, task_id: str, order: float) -> None:
        self.order[task_id], self.runs[task_id] = order, []
        self.created[task_id] = self.now
        self._new_run(task_id)

    def state(self, task_id: str) -> str:
        return self.runs[task_id][-1]

    def _new_run(self, task_id: str) -> None:
        self.runs[task_id].append("pending")
        self.since[task_id] = self.now
        self._event(task_id, "pending")

    def _event(self, task_id: str, state: str, reason: str = "") -> None:
        resolved = state in ("completed", "failed", "exception")
        self.events.append(
            TaskEvent(
                task_id,
                len(self.runs[task_id]) - 1,
                state,
                (self.key,),
                self.order[task_id],
                DEADLINE,
                self.since[task_id],
                reason,
                started_ms=self.now if state == "running" else 0,
                resolved_ms=self.now if resolved else 0,
            )
        )

    def _set(self, task_id: str, state: str, event: str, reason: str = "") -> None:
        self.runs[task_id][-1] = state
        self._event(task_id, event, reason)

    def run(self, task_id: str, passes: bool, minutes: int = 10) -> None:
        """A worker claims the pending run and reports its result ``minutes`` later."""
        self._set(task_id, "running", "running")
        self.now += minutes * MINUTE
        result = "completed" if passes else "failed"
        self._set(task_id, result, result, result)

    # -- QueueActions -------------------------------------------------------------------------
    async def hold(self, entry: Entry) -> Result:
        if self.state(entry.victim) == "pending":
            self._set(entry.victim, "held", "running")
        if self.state(entry.victim) == "held":
            return Result("held", due_ms=DEADLINE)
        return Result("gone")

    async def supersede(self, entry: Entry) -> Result:
        if self.state(entry.victim) not in ("pending", "held"):
            return Result("gone")
        self._set(entry.victim, "superseded", "exception", "superseded")
        self.superseded_by[entry.victim] = (entry.primary, entry.primary_run)
        return Result("superseded", saved="pending")

    async def release(self, entry: Entry) -> Result:
        runs = self.runs[entry.victim]
        if len(runs) - 1 == entry.run and runs[-1] == "held":
            self._set(entry.victim, "released", "exception", "worker-shutdown")
            self.released.append(entry.victim)
            self._new_run(entry.victim)
        return Result("released")

    async def cancel(self, entry: Entry) -> Result:
        return Result("gone")  # nothing runs while the search is checked

    async def renew(self, victim: str) -> Result:
        held = self.state(victim) == "held"
        return Result("held", due_ms=DEADLINE) if held else Result("lost")

    async def rerun(self, task_id: str, after_run: int) -> Result:
        runs = self.runs[task_id]
        if len(runs) - 1 == after_run and runs[-1] in ("completed", "failed"):
            self.reruns.append(task_id)
            self._new_run(task_id)
        return Result("rerun")

    async def dependencies(self, task_id: str) -> list[Relative]:
        return []  # one key, no task graph

    async def dependents(self, task_id: str) -> list[Relative]:
        return []

    async def created_ms(self, task_id: str) -> int | None:
        return self.created[task_id]

    async def prioritize(self, task_id: str) -> Result:
        if self.state(task_id) != "pending":
            raise AssertionError(f"{task_id} raised while {self.state(task_id)}")
        self.raised.append(task_id)
        return Result("raised")


async def search(
    n: int,
    culprit: int,
    *,
    record: bool = True,
    exact_runs: bool = True,
    confirm: int = 0,
    flaky: frozenset[int] = frozenset(),
    parallel: int = 1,
) -> None:
    """``n`` victims held for a primary; pushes ``culprit`` (``n``: the primary alone; ``n + 1``:
    none, the primary's failure is intermittent) and on fail; the first run of each push in
    ``flaky`` (good ones) fails too. ``parallel``: the search's runs at once (each round's
    released victims run together, in a shuffled order of their results)."""
    key = f"bisect.{uuid.uuid4().hex[:12]}"
    policy = rule(
        key,
        strategy="latest-wins",
        on_primary_failure="bisect",
        bisect_confirm=confirm,
        bisect_parallel=parallel,
    )
    queue = Queue(key)
    victims = [f"V{i:02d}{uuid.uuid4().hex[:18]}" for i in range(n)]
    primary = f"P{uuid.uuid4().hex[:21]}"
    for order, task_id in enumerate([*victims, primary]):
        queue.create(task_id, float(order))
    store = await open_store(REDIS_URL, grace_seconds=3600)
    await store.index_state(queue.now)  # the index knows every task from here, as in service
    enforcer = Enforcer(
        store,
        queue,
        consumer="prop",
        tick=3600.0,
        clock=lambda: datetime.fromtimestamp(queue.now / 1000, UTC),
    )

    async def settle() -> None:
        """Enforce and run every probe the search releases, until nothing is left to do."""
        for _ in range(200):
            events, queue.events = queue.events, []
            if events:
                await store.apply(events, now_ms=queue.now, policy=policy)
            done = await enforcer.round()
            # The primary runs first below; then only its confirmation is run here.
            pending = [
                t
                for t in pushes
                if queue.state(t) == "pending" and (t != primary or len(queue.runs[t]) > 1)
            ]
            for task_id in pending:
                i = pushes.index(task_id)
                first = len(queue.runs[task_id]) == 2  # released once: its first run
                queue.run(task_id, passes=i < culprit and not (i in flaky and first))
            if not (events or done or pending or queue.events):
                return
        raise AssertionError("the search did not end")

    pushes = [*victims, primary]
    try:
        await settle()
        assert all(queue.state(t) == "held" for t in victims)
        queue.run(primary, passes=False)
        await settle()
        await check(
            store, queue, key, victims, primary, culprit, record, exact_runs, confirm, parallel
        )
        if confirm:
            await check_intermittent(store, queue, key, victims, primary, culprit, flaky)
    finally:
        await store.close()


async def check(
    store: Store,
    queue: Queue,
    key: str,
    victims: list[str],
    primary: str,
    culprit: int,
    record: bool = True,
    exact_runs: bool = True,
    confirm: int = 0,
    parallel: int = 1,
) -> None:
    n = len(victims)
    ran = queue.released
    # Each round splits what is left into parallel + 1 parts.
    rounds = math.ceil(math.log(n + 1, parallel + 1) - 1e-9)
    assert len(ran) == len(set(ran)) <= parallel * rounds
    # Every run beyond the primary's first: probes and confirmations.
    made = sum(state in ("completed", "failed") for runs in queue.runs.values() for state in runs)
    if parallel == 1:
        assert made - 1 <= max_runs(n, confirm)
    assert made - 1 <= confirm + (1 + confirm) * len(ran)
    if not confirm:
        assert queue.reruns == []
    # Every run the search asked for went to the front of the queue (a rerun is asked for, and
    # raised, again until the index hears of it: harmless, the queue changes nothing twice).
    assert set(queue.raised) == {*ran, *queue.reruns}
    if record:  # hypothesis's statistics
        event(f"victims released to run: {len(ran)}")
        event(f"runs beyond the primary's first: {made - 1}")
    findings = await bisections.for_task(store, [key], primary)
    if n == 0:
        assert findings == []  # nothing to search: the primary's failure stands alone
        assert queue.runs[primary] == ["failed"]
    else:
        [finding] = findings
        assert finding["extraRuns"] == made - 1 == len(finding["runs"]) - 1
        # The run whose result is each push's verdict: its last.
        runs = {r["taskId"]: r["runId"] for r in finding["runs"]}
        if culprit > n:  # the primary's failure did not come back: it stands for every victim
            assert finding["culprit"] is None and finding["lastGood"] is None
            named = primary
        else:
            named = victims[culprit] if culprit < n else primary
            assert finding["culprit"] == {"taskId": named, "runId": runs[named]}
            good = finding["lastGood"]
            if culprit == 0:
                assert good is None
            else:
                assert good is not None and good["taskId"] == victims[culprit - 1]
        for i, task_id in enumerate(victims):
            decision = await records.decision(store, key, task_id)
            assert decision is not None
            if task_id in ran:
                verdict = "completed" if i < culprit else "failed"
                assert queue.runs[task_id][0] == "released"
                assert queue.runs[task_id][-1] == verdict
                assert len(queue.runs[task_id]) <= 2 + confirm
                assert decision.state == "ran"
                continue
            stand_in = victims[culprit - 1] if i < culprit and culprit <= n else named
            by = queue.superseded_by.get(task_id)
            assert (i, by and by[0]) == (i, stand_in)
            if exact_runs:
                assert (i, by) == (i, (stand_in, runs[stand_in]))
            assert queue.runs[task_id] == ["superseded"]
            assert decision.state == "superseded"
    # Nothing is left held, searched or to do.
    assert (await outbox.outstanding(store, [key]))[key] == (0, 0)
    assert await outbox.searches(store, key) == {}
    assert not any(state in ("held", "pending") for runs in queue.runs.values() for state in runs)


async def check_intermittent(
    store: Store,
    queue: Queue,
    key: str,
    victims: list[str],
    primary: str,
    culprit: int,
    flaky: frozenset[int],
) -> None:
    """With confirmations: what failed once and passed when run again is recorded as
    intermittent (its failed run), and nothing else is."""
    n = len(victims)
    if n == 0:
        return
    [finding] = await bisections.for_task(store, [key], primary)
    expected = [
        {"taskId": victims[i], "runId": 1}
        for i in sorted(flaky)
        if victims[i] in queue.released and i < culprit
    ]
    if culprit > n:
        expected.append({"taskId": primary, "runId": 0})
    assert sorted(finding["intermittent"], key=str) == sorted(expected, key=str)
    # A failure the search narrowed on was confirmed: each push that ran and failed ran twice.
    for task_id in [*queue.released, primary]:
        failed = [s for s in queue.runs[task_id] if s == "failed"]
        assert len(failed) != 1 or queue.runs[task_id][-1] == "completed", queue.runs[task_id]


@st.composite
def searches(draw: st.DrawFn) -> tuple[int, int]:
    n = draw(st.integers(0, 16))
    culprit = draw(st.one_of(st.just(n), st.integers(0, n)))  # n: only the primary fails
    return n, culprit


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=searches())
def test_the_enforcer_s_search_names_the_first_failing_push_within_the_bound(
    case: tuple[int, int],
) -> None:
    n, culprit = case
    event("only the primary fails" if culprit == n else "a victim is the culprit")
    asyncio.run(search(n, culprit))


@pytest.mark.parametrize("culprit", [3, 12])
def test_a_chain_deeper_than_nine_is_searched_whole(culprit: int) -> None:
    asyncio.run(search(12, culprit, record=False))


@st.composite
def flaky_searches(draw: st.DrawFn) -> tuple[int, int, frozenset[int]]:
    n = draw(st.integers(0, 12))
    # n: only the primary fails; n + 1: nothing does (the primary's failure is intermittent).
    culprit = draw(st.integers(0, n + 1))
    flaky = draw(st.frozensets(st.integers(0, max(0, min(culprit, n) - 1)), max_size=3))
    return n, culprit, frozenset(i for i in flaky if i < min(culprit, n))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=flaky_searches())
def test_with_confirmations_an_intermittent_failure_is_never_blamed(
    case: tuple[int, int, frozenset[int]],
) -> None:
    n, culprit, flaky = case
    if culprit > n:
        event("the primary's failure is intermittent")
    event(f"intermittent victims: {len(flaky)}")
    asyncio.run(search(n, culprit, confirm=1, flaky=flaky))


def test_a_stand_in_is_named_with_the_run_that_passed() -> None:
    # Three victims, failing from V02 on: V01 passes, V02 fails; V00, held for V01, is stood
    # for by V01's run 1.
    asyncio.run(search(3, 2, record=False, exact_runs=True))


@st.composite
def parallel_searches(draw: st.DrawFn) -> tuple[int, int, int]:
    n, culprit = draw(searches())
    return n, culprit, draw(st.integers(2, 4))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=parallel_searches())
def test_several_runs_at_once_name_the_same_push_in_fewer_rounds(
    case: tuple[int, int, int],
) -> None:
    n, culprit, parallel = case
    event(f"runs at once: {parallel}")
    asyncio.run(search(n, culprit, parallel=parallel))
