"""What a recorded run was (:mod:`coalescer.replay.runs`): work, held by the superseding side
whichever way it ended, canceled for a newer task while it ran, canceled by a person, or
canceled by the enforcer's cascade; and which runs size the pools."""

from __future__ import annotations

from typing import Any

import pytest

from coalescer.model import format_time_ms
from coalescer.replay.runs import (
    ENFORCER,
    Fate,
    Link,
    Recorded,
    fates,
    parse_identity,
    shared_worker,
    to_check,
    undecided,
)
from tests.replay.support import MIN, T0

WORKER = ("wg", "w1")


def run(
    run_id: int = 0,
    state: str = "completed",
    reason: str | None = None,
    *,
    start: float | None = 0,
    end: float | None = 10,
    by: tuple[str, str] | None = WORKER,
) -> dict[str, Any]:
    """A run claimed by ``by`` at minute ``start`` (None: never claimed), resolved at ``end``."""
    doc: dict[str, Any] = {"runId": run_id, "state": state, "scheduled": format_time_ms(T0)}
    if start is not None and by is not None:
        doc |= {"workerGroup": by[0], "workerId": by[1], "started": format_time_ms(at(start))}
    if end is not None:
        doc |= {"resolved": format_time_ms(at(end)), "reasonResolved": reason or state}
    return doc


def at(minute: float) -> int:
    return T0 + int(minute * MIN)


def task(
    task_id: str, *runs: dict[str, Any], key: str | None = "k", after: tuple[str, ...] = ()
) -> Recorded:
    return Recorded({"taskId": task_id, "runs": list(runs)}, (key,) if key else (), after)


def read(*tasks: Recorded, links: dict[tuple[str, int], Link] | None = None) -> dict[str, Fate]:
    return fates(tasks, links or {}, {ENFORCER}, shared_worker(tasks))


def test_a_run_that_did_its_work() -> None:
    found = read(task("a", run(state="failed", start=2, end=12)))["a"]
    assert found == Fate(worked=(at(2), at(12), "failed"), real=((at(2), at(12)),))


@pytest.mark.parametrize(
    ("state", "reason"),
    [("exception", "superseded"), ("exception", "canceled"), ("completed", "completed")],
)
def test_a_secondary_held_beside_its_primary_did_no_work_however_it_ended(
    state: str, reason: str
) -> None:
    tasks = (
        task("old", run(state=state, reason=reason, start=0, end=10)),
        task("new", run(start=0, end=10)),
    )
    found = read(*tasks, links={("old", 0): Link("new")})
    assert found["old"] == Fate(superseded_ms=at(10), superseded_by="new")
    assert found["new"].real == ((at(0), at(10)),) and found["new"].worked


def test_without_its_link_a_superseded_reason_still_tells() -> None:
    found = read(task("old", run(state="exception", reason="superseded")))["old"]
    assert (found.superseded_ms, found.superseded_by, found.real) == (at(10), "", ())


def test_the_enforcer_s_runs_are_superseded_and_never_real() -> None:
    found = read(
        task("a", run(state="exception", reason="canceled", start=1, end=1, by=ENFORCER)),
        task("b", run(state="completed", start=1, end=2, by=ENFORCER)),
        # Held by the enforcer, released (its primary failed), then run by a worker.
        task(
            "c",
            run(0, "exception", "worker-shutdown", start=1, end=5, by=ENFORCER),
            run(1, start=6, end=16),
        ),
    )
    assert found["a"] == Fate(superseded_ms=at(1)) and found["b"] == Fate(superseded_ms=at(2))
    assert found["c"] == Fate(worked=(at(6), at(16), "completed"), real=((at(6), at(16)),))


def test_a_running_task_canceled_for_a_newer_one_ran_until_then() -> None:
    canceled = run(state="exception", reason="canceled", start=0, end=4)
    found = read(task("old", canceled), links={("old", 0): Link("new")})["old"]
    assert found == Fate(superseded_ms=at(4), superseded_by="new", real=((at(0), at(4)),))


def test_a_cancel_nothing_explains_is_a_person_s() -> None:
    found = read(task("a", run(state="exception", reason="canceled", start=0, end=4)))["a"]
    assert found == Fate(canceled_ms=at(4), real=((at(0), at(4)),))
    unscheduled = run(state="exception", reason="canceled", start=None, end=3)
    assert read(task("b", unscheduled))["b"] == Fate(canceled_ms=at(3))


def test_a_cancel_beside_a_run_of_its_key_on_its_worker_sizes_no_pool_even_unexplained() -> None:
    found = read(
        task("old", run(state="exception", reason="canceled", start=0, end=10)),
        task("new", run(start=0, end=10)),
    )
    assert found["old"] == Fate(canceled_ms=at(10))


def test_the_enforcer_s_cascade_is_not_a_person_s_cancel() -> None:
    build = task("build", run(state="exception", reason="canceled", start=2, end=2, by=ENFORCER))
    never_ran = run(state="exception", reason="canceled", start=None, end=2)
    # In a task group: canceled before it ever ran, while the build it waits for was superseded.
    found = read(build, task("test", never_ran, after=("build",)))
    assert found["test"] == Fate(cascaded_ms=at(2), after="build")
    # From events (no dependencies): the lineage names the cascade and the task it waited for.
    found = read(task("test", never_ran), links={("test", 0): Link("build", cascade=True)})
    assert found["test"] == Fate(cascaded_ms=at(2), after="build")
    # A dependent of a build that ran, canceled unscheduled: a person's.
    found = read(task("build", run()), task("test", never_ran, after=("build",)))
    assert found["test"] == Fate(canceled_ms=at(2))


def test_runs_sharing_a_worker_with_a_run_of_their_key() -> None:
    tasks = (
        task("a", run(start=0, end=10)),
        task("b", run(state="exception", reason="canceled", start=0, end=10)),
        task("c", run(start=10, end=20)),  # after a, on the same worker: not beside it
        task("d", run(start=5, end=20), key="other"),
        task("e", run(start=5, end=20, by=("wg", "w2"))),
        task("f", run(start=12, end=14), key=None),
    )
    assert shared_worker(tasks) == {("a", 0), ("b", 0)}


def test_which_runs_a_link_is_read_for_and_which_only_a_link_can_tell() -> None:
    tasks = (
        task("held", run(state="exception", reason="canceled")),
        task("primary", run()),
        task("old-queue", run(state="exception", reason="superseded", start=20, end=30)),
        task("enforcer", run(start=30, end=31, by=ENFORCER)),
        task("alone", run(start=40, end=50)),
        task("failed", run(state="failed", start=0, end=10)),
        task("keyless", run(state="exception", reason="canceled", start=60, end=70), key=None),
        task("running", run(start=80, end=None)),
    )
    shared = shared_worker(tasks)
    refs = to_check(tasks, {ENFORCER}, shared)
    assert refs == [("held", 0), ("primary", 0), ("old-queue", 0), ("enforcer", 0)]
    assert undecided(tasks, refs, {ENFORCER}) == [("held", 0), ("primary", 0)]


def test_identities_are_group_slash_id() -> None:
    assert parse_identity("coalescer/enforcer") == ENFORCER
    for bad in ("coalescer", "/enforcer", "a/b/c", "a/"):
        with pytest.raises(ValueError, match="WORKER_GROUP/WORKER_ID"):
            parse_identity(bad)
