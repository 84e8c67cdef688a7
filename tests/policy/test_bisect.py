"""``on-primary-failure: bisect`` through ``coalescer enforce``: when the primary fails, the
held victims are searched for the first failing push, a few of them released to run, and the
rest superseded by the run whose result stands for them."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import orjson
import pytest
from taskcluster.exceptions import TaskclusterAuthFailure, TaskclusterRestFailure

from coalescer.bisection import max_runs
from coalescer.emulator.clock import format_time
from coalescer.emulator.harness import QueueEmulator
from coalescer.policy.actions import Result
from coalescer.policy.enforcer import Enforcer
from coalescer.policy.rules import Policy
from coalescer.store import Store, bisections
from coalescer.store import lineage as records
from coalescer.store import policy as outbox
from coalescer.store.policy import Entry
from tests.policy.support import Loop, rule

pytestmark = pytest.mark.integration


@pytest.fixture
def policy() -> Policy:
    # One run at a time, so that each step's probe is known (several at once: below).
    return rule(
        "k",
        strategy="latest-wins",
        on_primary_failure="bisect",
        bisect_confirm=0,
        bisect_parallel=1,
    )


async def state(loop: Loop, task_id: str) -> str | None:
    decision = await records.decision(loop.store, "k", task_id)
    return None if decision is None else decision.state


async def held_then_failed(loop: Loop, n: int = 8, **first: Any) -> tuple[list[str], str]:
    """``n`` victims held for a primary, which then fails; ``first`` overrides the oldest
    victim's definition."""
    victims = [loop.create(**(first if i == 0 else {})) for i in range(n)]
    primary = loop.create()
    await loop.feed()
    await loop.enforce()
    assert [await state(loop, t) for t in victims] == ["held"] * n
    claim = loop.claim(primary)
    loop.em.clock.advance(600)  # the primary runs 10 minutes
    loop.resolve(claim, "failed")
    return victims, primary


async def work(loop: Loop, victims: list[str], culprit: int, consumer: str = "e1") -> list[str]:
    """Enforce, and run every released victim as a worker would: its command fails from push
    ``culprit`` on. Returns the victims that ran, in order."""
    ran = []
    for _ in range(20):
        await enforce(loop, consumer)
        pending = [t for t in victims if loop.last_run(t)["state"] == "pending"]
        if not pending:
            return ran
        for task_id in pending:
            ran.append(task_id)
            how = "failed" if victims.index(task_id) >= culprit else "completed"
            loop.resolve(loop.claim(task_id), how)
    raise AssertionError("the search did not end")


async def drive(
    loop: Loop, enforcer: Enforcer, pushes: list[str], fails: Callable[[str], bool]
) -> None:
    """Round after round of ``enforcer``, each pending push then run as a worker would (failing
    when ``fails``), until none is pending."""
    for _ in range(20):
        for _ in range(200):
            await loop.feed()
            if not await enforcer.round():
                await loop.feed()
                break
        pending = [t for t in pushes if loop.last_run(t)["state"] == "pending"]
        if not pending:
            return
        for task_id in pending:
            loop.resolve(loop.claim(task_id), "failed" if fails(task_id) else "completed")
    raise AssertionError("the search did not end")


async def enforce(loop: Loop, consumer: str, raised: list[str] | None = None) -> None:
    """Enforce until the outbox drains; the tasks whose priority the enforcer asked the queue
    to change go to ``raised``, one entry a call."""
    async with loop.enforcer(consumer) as enforcer:
        if raised is not None:
            queue = enforcer.actions.queue
            change = queue.changeTaskPriority

            async def counted(task_id: str, payload: Any) -> Any:
                raised.append(task_id)
                return await change(task_id, payload)

            queue.changeTaskPriority = counted
        for _ in range(200):
            await loop.feed()
            if not await enforcer.round():
                await loop.feed()
                return
    raise AssertionError("the outbox did not drain")


async def check_outcome(
    loop: Loop, victims: list[str], primary: str, culprit: int, ran: list[str]
) -> None:
    n = len(victims)
    assert len(ran) == len(set(ran)) <= 4  # ceil(log2(8 + 1)) runs beyond the primary's
    good = culprit - 1
    stand_in = {i: victims[good] for i in range(good)}
    stand_in |= {i: victims[culprit] if culprit < n else primary for i in range(culprit + 1, n)}
    if culprit < n:
        assert victims[culprit] in ran
        assert loop.last_run(victims[culprit])["state"] == "failed"
    if good >= 0:
        assert victims[good] in ran
        assert loop.last_run(victims[good])["state"] == "completed"
    for i, task_id in enumerate(victims):
        if task_id in ran:
            assert (i, await state(loop, task_id)) == (i, "ran")
            continue
        run = loop.last_run(task_id)
        assert (i, run["runId"], run["reasonResolved"]) == (i, 0, "superseded")
        by = stand_in[i]
        by_run = 0 if by == primary else 1
        assert loop.artifact(task_id, 0, "public/superseded-by.json") == {
            "taskId": by,
            "runId": by_run,
        }
        assert await state(loop, task_id) == "superseded"
    [finding] = await bisections.for_task(loop.store, ["k"], primary)
    assert finding["primary"] == {"taskId": primary, "runId": 0}
    expected = {"taskId": victims[culprit], "runId": 1} if culprit < n else None
    assert finding["culprit"] == (expected or {"taskId": primary, "runId": 0})
    assert finding["lastGood"] == ({"taskId": victims[good], "runId": 1} if good >= 0 else None)
    assert finding["extraRuns"] == len(ran) and finding["held"] == n
    # Trusted failures (bisect-confirm 0): a culprit, however sure its one failure made it.
    assert finding["verdict"] == "culprit" and finding["suspect"] is None
    assert finding["flake"] == 0.05  # the prior's: the key has no findings yet
    assert 0.9 < finding["probability"] < 0.99
    # Nothing is left held, searched or to do.
    assert (await outbox.outstanding(loop.store, ["k"]))["k"] == (0, 0)


@pytest.mark.parametrize("culprit", [0, 3, 5, 7, 8])
async def test_a_failed_primary_locates_the_first_failing_push(loop: Loop, culprit: int) -> None:
    victims, primary = await held_then_failed(loop)
    ran = await work(loop, victims, culprit)
    await check_outcome(loop, victims, primary, culprit, ran)


async def test_a_released_victim_is_not_superseded_again_while_it_runs(loop: Loop) -> None:
    victims, _ = await held_then_failed(loop)
    await enforce(loop, "e1")
    [probe] = [t for t in victims if loop.last_run(t)["state"] == "pending"]
    assert await state(loop, probe) == "probing"
    # A newer push arrives while the probe waits for a worker: it does not supersede it.
    newer = loop.create()
    await enforce(loop, "e1")
    assert loop.last_run(probe)["state"] == "pending"
    assert await state(loop, probe) == "probing"
    assert loop.last_run(newer)["state"] == "pending"


async def test_an_enforcer_restarted_mid_search_resumes_it(loop: Loop) -> None:
    victims, primary = await held_then_failed(loop)
    # The first enforcer records its first probe, then dies before releasing it.
    async with loop.enforcer("e1") as enforcer:
        died: list[str] = []

        async def crash(entry: Entry) -> Result:
            died.append(entry.victim)
            raise RuntimeError("killed")

        enforcer.actions.release = crash  # type: ignore[method-assign]
        await loop.feed()
        await enforcer.round()
    [probe] = died
    assert await state(loop, probe) == "probing"
    assert loop.last_run(probe)["state"] == "running"  # still held: never released
    # Another enforcer takes over after the first probe's result, from the store alone.
    await enforce(loop, "e2")
    loop.resolve(loop.claim(probe), "completed" if victims.index(probe) < 5 else "failed")
    ran = [probe] + await work(loop, victims, 5, consumer="e2")
    await check_outcome(loop, victims, primary, 5, ran)


async def test_a_victim_whose_deadline_comes_first_is_released_to_run_itself(loop: Loop) -> None:
    # The primary ran 10 minutes: a victim whose deadline is within 20 minutes is not held.
    soon = format_time(loop.em.clock.now() + timedelta(minutes=25))
    victims, primary = await held_then_failed(loop, deadline=soon)
    ran = await work(loop, victims, 5)
    assert victims[0] in ran
    runs = loop.status(victims[0])["runs"]
    assert [(r["state"], r["reasonResolved"]) for r in runs] == [
        ("exception", "worker-shutdown"),
        ("completed", "completed"),  # it ran itself
    ]
    assert await state(loop, victims[0]) == "released"
    [finding] = await bisections.for_task(loop.store, ["k"], primary)
    assert finding["culprit"] == {"taskId": victims[5], "runId": 1}
    assert victims[0] not in {s["taskId"] for s in finding["standsFor"]}
    assert (await outbox.outstanding(loop.store, ["k"]))["k"] == (0, 0)


async def test_a_victim_held_for_a_search_that_is_over_is_released_not_held_for_good(
    loop: Loop, caplog: pytest.LogCaptureFixture
) -> None:
    victims, primary = await held_then_failed(loop, n=3)
    await loop.feed()  # the failure starts the search over what the primary held
    assert [await state(loop, t) for t in victims] == ["bisecting"] * 3
    # The search's record goes, its victims' lineage stays: renewing their claims would hold
    # their runs from every worker for good.
    [raw] = (await outbox.searches(loop.store, "k")).values()
    done = await outbox.search_step(
        loop.store, "k", primary, expected=raw, record=None, now_ms=loop.now_ms()
    )
    assert done
    with caplog.at_level(logging.WARNING, "coalescer.policy"):
        await enforce(loop, "e1")
        await enforce(loop, "e1")  # once: nothing is released twice
    for task_id in victims:
        assert await state(loop, task_id) == "released"
        assert runs_of(loop, task_id) == [("exception", "worker-shutdown"), ("pending", None)]
    said = [r.getMessage() for r in caplog.records if "none under way holds it" in r.getMessage()]
    assert sorted(line.split()[0] for line in said) == sorted(victims)
    assert (await outbox.outstanding(loop.store, ["k"]))["k"] == (0, 0)


# -- bisect-confirm: a failure the search would narrow on is run again (rerunTask) first -------
Fails = Callable[[int, int], bool]


def confirming(
    queue_emulator: QueueEmulator, store: Store, confirm: int = 1, parallel: int = 1
) -> Loop:
    policy = rule(
        "k",
        strategy="latest-wins",
        on_primary_failure="bisect",
        bisect_confirm=confirm,
        bisect_parallel=parallel,
    )
    return Loop(queue_emulator, store, policy)


async def work_all(loop: Loop, pushes: list[str], fails: Fails, consumer: str = "e1") -> list[str]:
    """Enforce, and run every pending push (victims and the primary, last) as a worker would:
    run ``r`` of push ``i`` fails when ``fails(i, r)``. Returns the runs made, as
    ``taskId/runId``, in order."""
    ran = []
    for _ in range(40):
        await enforce(loop, consumer)
        pending = [t for t in pushes if loop.last_run(t)["state"] == "pending"]
        if not pending:
            return ran
        for task_id in pending:
            run = loop.last_run(task_id)["runId"]
            ran.append(f"{task_id}/{run}")
            loop.em.clock.advance(60)
            how = "failed" if fails(pushes.index(task_id), run) else "completed"
            loop.resolve(loop.claim(task_id), how)
    raise AssertionError("the search did not end")


def runs_of(loop: Loop, task_id: str) -> list[tuple[str, str]]:
    return [(r["state"], r.get("reasonResolved")) for r in loop.status(task_id)["runs"]]


async def test_confirmed_failures_locate_the_culprit_and_an_intermittent_one_is_not_blamed(
    queue_emulator: QueueEmulator, store: Store
) -> None:
    loop = confirming(queue_emulator, store)
    victims, primary = await held_then_failed(loop)
    pushes = [*victims, primary]
    # Pushes 5 and on are broken; push 3 (the first probed) fails its first run only.
    ran = await work_all(loop, pushes, lambda i, run: i >= 5 or (i == 3 and run == 1))
    # The primary's failure came back when it ran again.
    assert runs_of(loop, primary) == [("failed", "failed"), ("failed", "failed")]
    assert ran[0] == f"{primary}/1"
    # Push 3: released to run (1), failed, ran again (2) and passed: intermittent, good.
    assert runs_of(loop, victims[3]) == [
        ("exception", "worker-shutdown"),
        ("failed", "failed"),
        ("completed", "completed"),
    ]
    # Push 5: failed, and failed again; push 4 passed.
    assert runs_of(loop, victims[5])[1:] == [("failed", "failed"), ("failed", "failed")]
    assert runs_of(loop, victims[4])[1:] == [("completed", "completed")]
    assert len(ran) <= max_runs(8, 1)
    [finding] = await bisections.for_task(loop.store, ["k"], primary)
    assert finding["culprit"] == {"taskId": victims[5], "runId": 2}
    assert finding["lastGood"] == {"taskId": victims[4], "runId": 1}
    assert finding["intermittent"] == [{"taskId": victims[3], "runId": 1}]
    assert finding["extraRuns"] == len(ran)
    assert [(r["taskId"], r["runId"], r["attempt"], r["passed"]) for r in finding["runs"]] == [
        (primary, 0, 0, False),
        (primary, 1, 1, False),
        (victims[3], 1, 0, False),
        (victims[3], 2, 1, True),
        (victims[5], 1, 0, False),
        (victims[5], 2, 1, False),
        (victims[4], 1, 0, True),
    ]
    # The others are superseded by the run that stands for them.
    for i in (0, 1, 2):
        assert loop.artifact(victims[i], 0, "public/superseded-by.json") == {
            "taskId": victims[4],
            "runId": 1,
        }
    for i in (6, 7):
        assert loop.artifact(victims[i], 0, "public/superseded-by.json") == {
            "taskId": victims[5],
            "runId": 2,
        }
    assert [await state(loop, t) for t in victims] == ["superseded"] * 3 + ["ran"] * 3 + [
        "superseded"
    ] * 2
    assert (await outbox.outstanding(loop.store, ["k"]))["k"] == (0, 0)
    # Every message again (events twice, out of order): nothing changes.
    loop.fed = 0
    await loop.feed()
    assert await outbox.searches(loop.store, "k") == {}
    assert (await outbox.outstanding(loop.store, ["k"]))["k"] == (0, 0)
    assert [await state(loop, t) for t in victims][3:6] == ["ran"] * 3


async def test_a_primary_whose_failure_does_not_come_back_stands_for_what_it_held(
    queue_emulator: QueueEmulator, store: Store
) -> None:
    loop = confirming(queue_emulator, store)
    victims, primary = await held_then_failed(loop, n=4)
    # A push newer than the primary arrives while its failure is confirmed: it neither
    # supersedes the rerun nor is superseded by it.
    await enforce(loop, "e1")
    assert loop.last_run(primary)["state"] == "pending"
    newer = loop.create()
    await enforce(loop, "e1")
    assert loop.last_run(primary)["state"] == "pending"
    assert loop.last_run(newer)["state"] == "pending"
    assert await records.decision(loop.store, "k", primary) is None
    ran = await work_all(loop, [*victims, primary], lambda i, run: False)
    assert ran == [f"{primary}/1"]
    assert runs_of(loop, primary) == [("failed", "failed"), ("completed", "completed")]
    for task_id in victims:
        assert runs_of(loop, task_id) == [("exception", "superseded")]
        assert loop.artifact(task_id, 0, "public/superseded-by.json") == {
            "taskId": primary,
            "runId": 1,
        }
        assert await state(loop, task_id) == "superseded"
    [finding] = await bisections.for_task(loop.store, ["k"], primary)
    assert finding["culprit"] is None and finding["lastGood"] is None
    assert finding["verdict"] == "flaky" and finding["suspect"] is None
    assert finding["intermittent"] == [{"taskId": primary, "runId": 0}]
    assert finding["extraRuns"] == 1
    assert {s["by"]["runId"] for s in finding["standsFor"]} == {1}
    assert (await outbox.outstanding(loop.store, ["k"]))["k"] == (0, 0)
    assert loop.last_run(newer)["state"] == "pending"  # the newest push, left to run


async def test_a_breakage_found_beside_a_flaky_primary_is_located_and_the_primary_stands_above(
    queue_emulator: QueueEmulator, store: Store
) -> None:
    """The primary's failure does not come back, but the push probed beside its confirmation
    fails twice: pushes 2 and 3 were broken and the primary's push is past the fix. The search
    locates that breakage; the pushes above it are stood for by the primary's passing run."""
    loop = confirming(queue_emulator, store, parallel=2)
    victims, primary = await held_then_failed(loop)
    pushes = [*victims, primary]
    ran = await work_all(loop, pushes, lambda i, run: i in (2, 3) or (i == 8 and run == 0))
    assert ran[:2] == [f"{victims[3]}/1", f"{primary}/1"]
    assert runs_of(loop, primary) == [("failed", "failed"), ("completed", "completed")]
    [finding] = await bisections.for_task(loop.store, ["k"], primary)
    assert finding["verdict"] == "culprit"
    assert finding["culprit"] == {"taskId": victims[2], "runId": 2}
    assert finding["lastGood"] == {"taskId": victims[1], "runId": 1}
    assert finding["intermittent"] == [{"taskId": primary, "runId": 0}]
    for i in (4, 5, 6, 7):
        assert loop.artifact(victims[i], 0, "public/superseded-by.json") == {
            "taskId": primary,
            "runId": 1,
        }
        assert await state(loop, victims[i]) == "superseded"
    assert (await outbox.outstanding(loop.store, ["k"]))["k"] == (0, 0)


async def test_without_the_rerun_scope_failures_are_trusted_and_said_once(
    queue_emulator: QueueEmulator, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    loop = confirming(queue_emulator, store)
    victims, primary = await held_then_failed(loop)
    refused = []
    async with loop.enforcer("e1") as enforcer:

        async def no_scope(task_id: str) -> Any:
            refused.append(task_id)
            raise TaskclusterAuthFailure("missing scope queue:rerun-task", status_code=403)

        enforcer.actions.queue.rerunTask = no_scope  # type: ignore[attr-defined]
        await drive(loop, enforcer, victims, lambda task_id: victims.index(task_id) >= 5)
    # Each failure was trusted as it stood: the primary's, then push 5's (3 and 4 passed).
    assert refused == [primary, victims[5]]
    assert len(loop.status(primary)["runs"]) == 1
    [finding] = await bisections.for_task(loop.store, ["k"], primary)
    assert finding["culprit"] == {"taskId": victims[5], "runId": 1}
    assert finding["lastGood"] == {"taskId": victims[4], "runId": 1}
    assert finding["intermittent"] == []
    assert finding["extraRuns"] == len(finding["runs"]) - 1 <= 4
    assert all(r["attempt"] == 0 for r in finding["runs"])
    said = [r for r in caplog.records if "refused to rerun" in r.getMessage()]
    assert len(said) == 1
    assert (await outbox.outstanding(loop.store, ["k"]))["k"] == (0, 0)


async def test_an_enforcer_killed_before_a_rerun_resumes_it_once(
    queue_emulator: QueueEmulator, store: Store
) -> None:
    loop = confirming(queue_emulator, store)
    victims, primary = await held_then_failed(loop, n=4)
    # The first enforcer records the primary's confirmation, then dies before the rerun.
    async with loop.enforcer("e1") as enforcer:

        async def killed(task_id: str, after_run: int) -> Result:
            raise RuntimeError("killed")

        enforcer.actions.rerun = killed  # type: ignore[method-assign]
        await loop.feed()
        await enforcer.round()
    [raw] = (await outbox.searches(loop.store, "k")).values()
    [probe] = orjson.loads(raw)["probes"]
    assert (probe["i"], probe["run"], probe["attempt"]) == (4, 0, 1)  # the primary's run 0
    assert len(loop.status(primary)["runs"]) == 1
    # Another enforcer reruns it, once, however often it looks before the rerun's events.
    async with loop.enforcer("e2") as enforcer:
        for _ in range(3):
            await enforcer.round()
    assert runs_of(loop, primary) == [("failed", "failed"), ("pending", None)]
    ran = await work_all(loop, [*victims, primary], lambda i, run: i >= 2, consumer="e2")
    assert runs_of(loop, primary) == [("failed", "failed"), ("failed", "failed")]
    [finding] = await bisections.for_task(loop.store, ["k"], primary)
    assert finding["culprit"] == {"taskId": victims[2], "runId": 2}
    assert finding["extraRuns"] == len(ran)


def priority(loop: Loop, task_id: str) -> str:
    return str(loop.em.queue().task(task_id)["priority"])


async def test_probes_jump_the_queue_and_reruns_keep_their_place(
    queue_emulator: QueueEmulator, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    loop = confirming(queue_emulator, store)
    victims, primary = await held_then_failed(loop, n=4)
    assert {priority(loop, t) for t in [*victims, primary]} == {"lowest"}
    await enforce(loop, "e1")
    # The primary's failure runs again first. The queue (as release 106's) will not change
    # the priority of a task its dependency resolver has marked resolved, rerun or not: the
    # confirmation keeps its place in line.
    assert loop.last_run(primary)["state"] == "pending"
    assert priority(loop, primary) == "lowest"
    loop.resolve(loop.claim(primary), "failed")
    await enforce(loop, "e1")
    # A released victim was never resolved: its new run goes to the front of its task queue.
    [probe] = [t for t in victims if loop.last_run(t)["state"] == "pending"]
    assert priority(loop, probe) == "highest"
    assert {priority(loop, t) for t in victims if t != probe} == {"lowest"}
    changed = [m for m in loop.em.published if m["exchange"].endswith("task-priority-changed")]
    assert [m["payload"]["status"]["taskId"] for m in changed] == [probe]
    said = [r for r in caplog.records if "will not raise the priority" in r.getMessage()]
    assert len(said) == 1 and primary in said[0].getMessage()


async def test_without_change_task_priority_probes_wait_in_line_and_it_is_said_once(
    queue_emulator: QueueEmulator, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    loop = confirming(queue_emulator, store)
    victims, primary = await held_then_failed(loop)
    asked = []
    async with loop.enforcer("e1") as enforcer:

        async def no_method(task_id: str, payload: Any) -> Any:
            asked.append(task_id)
            raise TaskclusterRestFailure("Not Found", superExc=None, status_code=404)

        enforcer.actions.queue.changeTaskPriority = no_method  # type: ignore[attr-defined]
        pushes = [*victims, primary]
        await drive(loop, enforcer, pushes, lambda task_id: pushes.index(task_id) >= 5)
    [finding] = await bisections.for_task(loop.store, ["k"], primary)
    assert finding["culprit"] == {"taskId": victims[5], "runId": 2}
    assert finding["verdict"] == "culprit" and finding["probability"] > 0.99
    assert len(asked) >= 3 and {priority(loop, t) for t in [*victims, primary]} == {"lowest"}
    said = [r for r in caplog.records if "did not raise the priority" in r.getMessage()]
    assert len(said) == 1


async def test_several_probes_run_at_once_and_find_the_same_culprit(
    queue_emulator: QueueEmulator, store: Store
) -> None:
    loop = confirming(queue_emulator, store, confirm=0, parallel=2)
    victims, primary = await held_then_failed(loop)
    await enforce(loop, "e1")
    # The eight pushes split in three: pushes 2 and 5 run at once, both at the front.
    pending = [t for t in victims if loop.last_run(t)["state"] == "pending"]
    assert pending == [victims[2], victims[5]]
    assert {priority(loop, t) for t in pending} == {"highest"}
    assert {await state(loop, t) for t in pending} == {"probing"}
    ran = await work(loop, victims, 6)
    # Rounds, not runs, are what the sheriff waits for: two here (pushes 2 and 5, then the two
    # left, 6 and 7), against three or four one at a time.
    assert ran == [victims[2], victims[5], victims[6], victims[7]]
    [finding] = await bisections.for_task(loop.store, ["k"], primary)
    assert finding["rounds"] == 2 and finding["extraRuns"] == 4
    assert finding["culprit"] == {"taskId": victims[6], "runId": 1}
    assert finding["lastGood"] == {"taskId": victims[5], "runId": 1}
    assert (await outbox.outstanding(loop.store, ["k"]))["k"] == (0, 0)
