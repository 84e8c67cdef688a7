"""The soak's checker finds each kind of violation it is meant to (fed a queue's answers
directly), and none in a history where everything went right."""

from __future__ import annotations

from typing import Any

from tests.soak import checker
from tests.soak.load import Pushed


class FakeQueue(checker.Queue):
    def __init__(
        self,
        statuses: dict[str, Any],
        blobs: dict[tuple[str, int, str], Any],
        messages: list[tuple[Any, ...]],
    ) -> None:
        self._statuses, self._blobs, self._messages = statuses, blobs, messages

    async def statuses(self, task_ids: Any) -> dict[str, dict[str, Any]]:
        return {t: self._statuses[t] for t in task_ids if t in self._statuses}

    async def blob(self, task_id: str, run_id: int, name: str) -> Any | None:
        return self._blobs.get((task_id, run_id, name))

    async def messages(self, kind: str) -> list[dict[str, Any]]:
        """``(kind, taskId, runId)``: the run as the queue has it in the end; a 4th item is the
        run the message shows instead."""
        found = []
        for k, t, r, *said in self._messages:
            if k != kind:
                continue
            runs = [dict(one) for one in self._statuses.get(t, {}).get("runs", [])]
            if said:
                runs[r:] = [said[0]]
            found.append({"payload": {"status": {"taskId": t, "runs": runs}, "runId": r}})
        return found


def run(state: str, reason: str | None = None, created: str = "scheduled") -> dict[str, Any]:
    found = {"runId": 0, "state": state, "reasonCreated": created}
    if reason:
        found["reasonResolved"] = reason
    return found


def status(*runs: dict[str, Any]) -> dict[str, Any]:
    for i, r in enumerate(runs):
        r["runId"] = i
    state = runs[-1]["state"] if runs else "unscheduled"
    return {"state": state, "runs": list(runs)}


TASKS = {
    "old": Pushed("old", "k", 1, 0.0),
    "new": Pushed("new", "k", 2, 0.0),
    "dep": Pushed("dep", "dep.k", 3, 0.0, ("old",)),
}


async def check(statuses: dict[str, Any], blobs: dict[Any, Any], messages: list[Any]) -> list[str]:
    findings = checker.Findings()
    await checker.check_queue(FakeQueue(statuses, blobs, messages), TASKS, findings)
    return [v.invariant for v in findings.violations]


def good() -> tuple[dict[str, Any], dict[Any, Any], list[Any]]:
    statuses = {
        "old": status(run("exception", "canceled")),
        "new": status(run("completed", "completed")),
        "dep": status(),
    }
    blobs = {
        ("old", 0, "public/superseded-by.json"): {"taskId": "new", "runId": 0},
        ("new", 0, "public/supersedes.json"): [{"taskId": "old", "runId": 0}],
    }
    messages = [("task-exception", "old", 0), ("task-completed", "new", 0)]
    return statuses, blobs, messages


async def test_a_history_without_faults_has_no_violation() -> None:
    assert await check(*good()) == []


async def test_a_run_resolved_twice_or_never_is_found() -> None:
    statuses, blobs, messages = good()
    failed = {**run("failed", "failed"), "runId": 0}
    assert await check(statuses, blobs, [*messages, ("task-failed", "new", 0, failed)]) == [
        "every run resolved once"
    ]
    assert await check(statuses, blobs, [("task-completed", "new", 0)]) == [
        "every resolution published"
    ]
    statuses["new"] = status(run("running"))
    assert "every run resolved" in await check(statuses, blobs, messages)


async def test_a_resolution_published_again_is_counted_not_a_violation() -> None:
    # cancelTask on a canceled task, a repeated report: the queue publishes the same resolution
    # again (and Pulse may deliver any message twice); the run is still resolved once.
    statuses, blobs, messages = good()
    findings = checker.Findings()
    again = [*messages, ("task-exception", "old", 0), ("task-completed", "new", 0)]
    await checker.check_queue(FakeQueue(statuses, blobs, again), TASKS, findings)
    assert findings.violations == []
    assert findings.counts["resolution messages repeated"] == 2


async def test_an_older_winner_and_a_primary_that_held_a_newer_task_are_found() -> None:
    statuses, blobs, messages = good()
    statuses["old"] = status(run("completed", "completed"))
    statuses["new"] = status(run("exception", "canceled"))
    blobs = {
        ("new", 0, "public/superseded-by.json"): {"taskId": "old", "runId": 0},
        ("old", 0, "public/supersedes.json"): [{"taskId": "new", "runId": 0}],
    }
    messages = [("task-completed", "old", 0), ("task-exception", "new", 0)]
    assert sorted(await check(statuses, blobs, messages)) == [
        "only newer supersedes older",
        "the winner is the newest it held",
    ]


async def test_a_dependent_scheduled_for_a_canceled_dependency_is_found() -> None:
    statuses, blobs, messages = good()
    statuses["dep"] = status(run("completed", "completed"))
    found = await check(statuses, blobs, [*messages, ("task-completed", "dep", 0)])
    assert found == ["all-completed dependents run only after their dependencies"]
    statuses["dep"] = status(run("exception", "canceled", created="exception"))  # a cascade
    assert await check(statuses, blobs, [*messages, ("task-exception", "dep", 0)]) == []


def test_dead_letters_other_than_the_invalid_messages_sent_are_found() -> None:
    findings = checker.Findings()
    checker.check_dead_letters([b"{soak: invalid 1"], 1, findings)
    assert findings.violations == []
    checker.check_dead_letters([b'{"version": 1}'], 1, findings)
    assert [v.invariant for v in findings.violations] == [
        "the dead-letter queue holds only invalid messages"
    ]


def test_memory_that_keeps_growing_is_found() -> None:
    mib = 2**20
    flat = [(float(t), "serve", 1, 100 * mib + (t % 3) * mib) for t in range(30)]
    growing = [(float(t), "listen-1", 2, 60 * mib + t * 4 * mib) for t in range(30)]
    findings = checker.Findings()
    peak = checker.check_memory(flat + growing, findings)
    assert [v.detail.split(" ")[0] for v in findings.violations] == ["listen-1"]
    assert peak == {"serve": 102 * mib, "listen-1": 176 * mib}


def canceled(started: str, resolved: str) -> dict[str, Any]:
    return {**run("exception", "canceled"), "started": started, "resolved": resolved}


def test_a_running_task_canceled_without_its_rule_allowing_it_is_found() -> None:
    tasks = {
        "lw": Pushed("lw", "lw.0", 1, 0.0),
        "sr": Pushed("sr", "sr.0", 2, 0.0),
        "old": Pushed("old", "sr.0", 3, 0.0),
        "held": Pushed("held", "lw.0", 4, 0.0),
    }
    statuses = {
        "lw": status(canceled("2030-01-01T00:00:00.000Z", "2030-01-01T00:00:01.000Z")),
        "sr": status(canceled("2030-01-01T00:00:00.000Z", "2030-01-01T00:00:02.000Z")),
        "old": status(canceled("2030-01-01T00:00:00.000Z", "2030-01-01T00:00:09.000Z")),
        "held": status(canceled("2030-01-01T00:00:00.000Z", "2030-01-01T00:00:09.000Z")),
    }
    ran = {("lw", 0), ("sr", 0), ("old", 0)}  # "held" never ran: a secondary superseded

    def rule_of(key: str) -> checker.Rule:
        return checker.Rule(True, 3000) if key.startswith("sr.") else checker.Rule()

    findings = checker.Findings()
    checker.check_cancels(tasks, statuses, ran, rule_of, findings)
    assert [v.detail.split(" ")[0] for v in findings.violations] == ["lw", "old"]
    assert findings.counts["running tasks canceled"] == 3


def test_a_completed_run_whose_command_never_started_is_found() -> None:
    statuses, _, _ = good()
    findings = checker.Findings()
    checker.check_completed_ran(TASKS, statuses, {("new", 0)}, findings)
    assert findings.violations == []
    checker.check_completed_ran(TASKS, statuses, set(), findings)
    assert [v.invariant for v in findings.violations] == [
        "no task that did not run reads completed"
    ]
    findings = checker.Findings()
    checker.check_completed_ran(TASKS, statuses, set(), findings, completed_named=True)
    assert findings.violations == []


def test_culprits_other_than_where_the_breakage_began_are_found() -> None:
    tasks = {
        "p1": Pushed("p1", "k", 1, 0.0),
        "p2": Pushed("p2", "k", 2, 0.0),
        "b3": Pushed("b3", "k", 3, 0.0, fate="broken"),
        "b4": Pushed("b4", "k", 4, 0.0, fate="broken"),
        "f5": Pushed("f5", "f", 5, 0.0, fate="flaky"),
    }
    log = (
        "INFO culprit located: task b3 run 0 is the first failing of 3 tasks held by <Claim "
        "b4/0>; last good task p2 run 0; 2 extra runs, 0 intermittent\n"
        "INFO culprit located: task b4 run 1 is the first failing of 2 tasks held by x; "
        "last good none; 1 extra runs, 0 intermittent\n"
    )
    right = checker.culprits_in_log("w", log)
    assert [(c.task_id, c.last_good) for c in right] == [("b3", "p2"), ("b4", None)]
    findings = checker.Findings()
    checker.check_culprits(tasks, right, findings)
    assert findings.violations == []
    assert findings.counts["culprits named, by key"] == {"k": 2}

    wrong = [
        checker.Culprit("w", "p2", "p1"),  # the last good push named instead
        checker.Culprit("w", "b4", "p2"),  # a pass below it, yet not the first failing
        checker.Culprit("w", "b4", "b3"),  # a failing push as the last good
        *checker.culprits_in_lineage(
            "f5", {"bisection": [{"by": "enforcer", "culprit": {"taskId": "f5"}}]}
        ),
    ]
    checker.check_culprits(tasks, wrong, findings)
    assert [v.invariant for v in findings.violations] == [
        "every culprit is where the breakage began",
        "every culprit is where the breakage began",
        "every culprit is where the breakage began",
        "no flaky key gets a culprit",
    ]


def test_an_event_lost_after_the_index_was_last_lost_is_found() -> None:
    tasks = {
        "before": Pushed("before", "k", 1, 10.0),
        "a": Pushed("a", "k", 2, 30.0),
        "b": Pushed("b", "k", 3, 31.0),
        "c": Pushed("c", "k", 4, 32.0),
        "unscheduled": Pushed("unscheduled", "dep.k", 5, 33.0, ("a",)),
    }
    statuses = {
        "before": status(run("completed", "completed")),
        "a": status(run("completed", "completed")),
        "b": status(run("exception", "canceled")),
        "c": status(run("failed", "failed"), run("completed", "completed")),
        "unscheduled": status(),
    }
    index = {"k": {"a": (0, "completed"), "b": (0, "exception"), "c": (1, "completed")}}
    findings = checker.Findings()
    checker.check_index(tasks, statuses, index, 20.0, findings)
    assert findings.violations == []
    assert findings.counts["tasks checked against the index"] == 3
    index = {"k": {"a": (0, "running"), "c": (1, "completed")}}
    checker.check_index(tasks, statuses, index, 20.0, findings)
    assert [v.invariant for v in findings.violations] == ["every event acknowledged was applied"]
    assert "missing ['b']" in findings.violations[0].detail


def test_a_run_scheduled_after_the_index_was_last_lost_is_checked_too() -> None:
    tasks = {
        "dependent": Pushed("dependent", "k", 1, 10.0, ("a",)),
        "retried": Pushed("retried", "k", 2, 11.0),
        "old": Pushed("old", "k", 3, 12.0),
    }
    later, earlier = "1970-01-01T00:00:25.000Z", "1970-01-01T00:00:15.000Z"
    statuses = {
        "dependent": status({**run("completed", "completed"), "scheduled": later}),
        "retried": status(
            {**run("exception", "worker-shutdown"), "scheduled": earlier},
            {**run("completed", "completed", "retry"), "scheduled": later},
        ),
        "old": status({**run("completed", "completed"), "scheduled": earlier}),
    }
    findings = checker.Findings()
    checker.check_index(tasks, statuses, {"k": {}}, 20.0, findings)
    assert findings.counts["tasks checked against the index"] == 2
    assert "missing ['dependent', 'retried']" in findings.violations[0].detail
    # an older task held otherwise than the queue is no violation here, but is described
    older = checker.check_index(tasks, statuses, {"k": {"old": (0, "pending")}}, 20.0, findings)
    assert len(older) == 1 and older[0].startswith("old (k, created -8 s from the last loss)")
    assert "pending run 0 (queue: completed run 0" in older[0]
