"""Failed primaries in the replay: synthetic regressions and intermittent failures, seeded and
at the rates asked for; a worker's ``supersede``, ``release`` and ``bisect`` after its primary
failed, with exact figures on a small history; and the report's rows that compare them."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from coalescer.errors import ConfigError, InvalidInput
from coalescer.policy import HoldBy, PrimaryFailure, rules
from coalescer.replay import report
from coalescer.replay.history import History, TaskSpec, priority_rank
from coalescer.replay.metrics import Summary, regressions, summarize
from coalescer.replay.pool import Outcome, Pool, Search, State
from coalescer.replay.runner import Config, replay
from coalescer.replay.synthetic import Synthetic, generate
from coalescer.store import open_store
from tests.conftest import REDIS_URL
from tests.replay.support import T0, history, minutes, task

pytestmark = pytest.mark.integration


# -- synthetic histories ----------------------------------------------------------------------
def broken_by_key(h: History) -> dict[str, list[bool]]:
    found: dict[str, list[bool]] = {}
    for t in sorted(h.tasks, key=lambda t: t.order):
        found.setdefault(t.keys[0], []).append(t.broken)
    return found


def test_synthetic_regressions_are_seeded_and_leave_the_rest_of_the_history_alone() -> None:
    plain = generate(Synthetic(hours=12, seed=3))
    spec = Synthetic(hours=12, seed=3, regression_rate=0.1, intermittent_rate=0.05)
    first, again = generate(spec), generate(spec)
    assert first == again
    assert generate(dataclasses.replace(spec, seed=4)) != first
    # The same pushes, tasks and run times: only which pushes are broken is added.
    strip = [dataclasses.replace(t, broken=False) for t in first.tasks]
    assert strip == list(plain.tasks)
    assert not any(t.broken for t in plain.tasks) and plain.intermittent == 0
    assert first.intermittent == 0.05 and any(t.broken for t in first.tasks)


def test_synthetic_regressions_come_at_the_rate_asked_and_are_fixed_within_fix_after() -> None:
    spec = Synthetic(hours=72, pushes_per_hour=30, regression_rate=0.08, fix_after=4, seed=1)
    h = generate(spec)
    starts = eligible = 0
    lengths: list[int] = []
    for pushes in broken_by_key(h).values():
        run = 0
        for n, broken in enumerate(pushes):
            if n and not pushes[n - 1]:
                eligible += 1
                starts += broken
            run = run + 1 if broken else 0
            if run and (n + 1 == len(pushes) or not pushes[n + 1]):
                lengths.append(run)
    assert eligible > 5000
    assert abs(starts / eligible - 0.08) < 0.01
    # Back to back breakages read as one; otherwise each lasts 1-4 pushes, 2.5 on average.
    assert min(lengths) == 1 and sum(1 for n in lengths if n <= 4) / len(lengths) > 0.9
    assert abs(sum(n for n in lengths if n <= 4) / sum(1 for n in lengths if n <= 4) - 2.5) < 0.2
    assert len(regressions(h)) == starts


def test_bad_synthetic_rates_are_refused() -> None:
    for bad in ({"regression_rate": 1.5}, {"intermittent_rate": -0.1}, {"fix_after": 0}):
        with pytest.raises(InvalidInput):
            Synthetic(**bad)  # type: ignore[arg-type]


def test_intermittent_failures_come_at_the_rate_asked_per_run_and_are_seeded() -> None:
    tasks = [task(f"t{n}", n, 1, key=f"k{n}") for n in range(4000)]
    h = dataclasses.replace(history(*tasks, workers=50), intermittent=0.05)

    def failed(seed: int) -> list[bool]:
        out = asyncio.run(Pool(h, None, seed=seed).run())
        return [s == State.FAILED for s in out.state]

    first = failed(0)
    assert failed(0) == first and failed(1) != first
    assert abs(sum(first) / len(first) - 0.05) < 0.01


# -- the three modes on one small history ------------------------------------------------------
#: One worker. p0 runs 0-10 min while p1..p8 arrive; at 10 the worker claims p1, holds p1..p8
#: and runs p8, the primary. The key is broken from p5 on: p5 is the culprit, p4 the last good.
PUSHES = tuple(task(f"p{n}", n, 10, order=n, key="k") for n in range(9))


def broken_from(culprit: int) -> History:
    return history(*(dataclasses.replace(t, broken=t.order >= culprit) for t in PUSHES))


def run(h: History, config: Config) -> tuple[Outcome, Summary]:
    async def go() -> list[Outcome]:
        store = await open_store(REDIS_URL, grace_seconds=3600)
        try:
            return await replay(h, [Config(False), config], store)
        finally:
            await store.close()

    off, out = asyncio.run(go())
    base = summarize(h, "off", off, None)
    return out, summarize(h, config.name, out, base.worker_hours)


def fates(h: History, out: Outcome) -> dict[str, tuple[str, float, str]]:
    """Each task's state, when it resolved (minutes in) and who superseded it."""
    return {
        t.task_id: (
            out.state[i].name.lower(),
            minutes(out.resolved_ms[i]),
            h.tasks[out.by[i]].task_id if out.by[i] >= 0 else "",
        )
        for i, t in enumerate(h.tasks)
    }


def on_claim(failure: str, confirm: int | None = None) -> Config:
    text = f"on-claim,on-primary-failure={failure}"
    return Config.parse(text if confirm is None else f"{text},bisect-confirm={confirm}")


def test_supersede_leaves_the_older_pushes_without_a_result() -> None:
    h = broken_from(5)
    out, s = run(h, on_claim("supersede"))
    assert fates(h, out) == {
        "p0": ("completed", 10, ""),
        **{f"p{n}": ("superseded", 20, "p8") for n in range(1, 8)},
        "p8": ("failed", 20, ""),
    }
    assert (s.worker_hours, s.regressions, s.seen, s.located, s.extra_runs) == (
        20 / 60,
        1,
        1,
        0,
        0,
    )
    assert s.locate_p50_s is None and s.bisections == 0


def test_release_runs_every_held_push_itself_one_after_another_on_one_worker() -> None:
    h = broken_from(5)
    out, s = run(h, on_claim("release"))
    assert fates(h, out) == {
        "p0": ("completed", 10, ""),
        **{f"p{n}": ("completed", 20 + 10 * n, "") for n in range(1, 5)},
        **{f"p{n}": ("failed", 20 + 10 * n, "") for n in range(5, 8)},
        "p8": ("failed", 20, ""),
    }
    assert out.runs[h.tasks.index(PUSHES[1])] == 2  # released, then its own run
    assert (s.worker_hours, s.located, s.extra_runs, s.released) == (1.5, 1, 7, 7)
    # p8 failed at 20; p5 failed at 70, p4 had passed at 60.
    assert s.locate_p50_s == s.locate_p95_s == 50 * 60


def test_bisect_runs_a_few_pushes_and_names_the_culprit() -> None:
    h = broken_from(5)
    out, s = run(h, on_claim("bisect"))
    # p8 fails (20), is confirmed (30); p4 passes (40); p6 fails (50), confirmed (60): p8 is
    # no longer needed; p5 fails (70), confirmed (80): the culprit, p4 the last good.
    assert fates(h, out) == {
        "p0": ("completed", 10, ""),
        **{f"p{n}": ("superseded", 80, "p4") for n in range(1, 4)},
        "p4": ("completed", 80, ""),
        "p5": ("failed", 80, ""),
        "p6": ("failed", 80, ""),
        "p7": ("superseded", 80, "p5"),
        "p8": ("failed", 60, ""),
    }
    assert out.searches == [Search(8, 5, 4, minutes_ms(20), minutes_ms(80), 6)]
    assert (s.worker_hours, s.located, s.extra_runs, s.bisections, s.wrong_culprits) == (
        80 / 60,
        1,
        6,
        1,
        0,
    )
    assert s.locate_p50_s == 60 * 60
    assert out.state.count(State.SUPERSEDED) == 4 and s.run == 5
    assert s.wrong_winners == 0  # p7 stood for by the culprit, older than it: right


def test_bisect_without_confirmation_takes_three_runs_for_eight_pushes() -> None:
    h = broken_from(5)
    out, s = run(h, on_claim("bisect", 0))
    assert s.name == "on-claim always, bisect confirm 0"
    assert out.searches == [Search(8, 5, 4, minutes_ms(20), minutes_ms(50), 3)]
    assert (s.worker_hours, s.located, s.extra_runs) == (50 / 60, 1, 3)
    assert s.locate_p50_s == 30 * 60
    assert fates(h, out)["p7"] == ("superseded", 50, "p5")


def test_a_worker_names_no_culprit_over_a_push_another_worker_ran() -> None:
    # p5, where the breakage began, runs on another pool's worker (and fails there): the
    # worker's search over what it held finds p6 the first failing after p4 passed. As the
    # shim does (GET /v1/bisections/gap), it learns p5 did not pass: inconclusive, no culprit.
    elsewhere = dataclasses.replace(PUSHES[5], task_queue="q2")
    h = history(
        *(dataclasses.replace(t, broken=t.order >= 5) for t in [*PUSHES[:5], elsewhere]),
        *(dataclasses.replace(t, broken=True) for t in PUSHES[6:]),
    )
    out, s = run(h, on_claim("bisect"))
    [search] = out.searches
    assert (h.tasks[search.last_good].task_id, search.culprit) == ("p4", -1)
    assert (s.wrong_culprits, s.located) == (0, 1)  # p5 failed, p4 passed: located by results
    assert fates(h, out)["p5"][0] == "failed"


def test_a_culprit_where_no_regression_began_is_counted_wrong() -> None:
    # Nothing is broken, but p8 was recorded failed (it fails every run): the search confirms
    # it, p4, p6 and p7 pass, and it names p8 with p7 the last good.
    h = history(*PUSHES[:8], dataclasses.replace(PUSHES[8], outcome="failed"))
    out, s = run(h, on_claim("bisect"))
    assert out.searches == [Search(8, 8, 7, minutes_ms(20), minutes_ms(60), 4)]
    assert (s.regressions, s.located, s.wrong_culprits) == (0, 0, 1)
    assert fates(h, out)["p1"] == ("superseded", 60, "p7")


def recorded(t: TaskSpec, *, ran: bool = True, failed: bool = False) -> TaskSpec:
    """``t`` as a recorded history has it: its run (if it ran) and its result."""
    end = t.scheduled_ms + (t.duration_ms or 0)
    return dataclasses.replace(
        t,
        outcome="failed" if failed else "completed",
        started_ms=t.scheduled_ms if ran else 0,
        resolved_ms=end if ran else 0,
        real_runs=((t.scheduled_ms, end),) if ran else (),
    )


def test_on_a_recorded_history_a_culprit_after_a_passing_push_is_right() -> None:
    # Recorded: p4 passed, p5 to p8 failed. The search names p5, p4 the last good: right.
    tasks = [recorded(t, failed=n >= 5) for n, t in enumerate(PUSHES)]
    h = history(*tasks)
    assert h.is_recorded
    out, s = run(h, on_claim("bisect"))
    assert [(f.culprit, f.last_good) for f in out.searches] == [(5, 4)]
    assert (s.wrong_culprits, s.culprits_unknown) == (0, 0)


def test_on_a_recorded_history_a_culprit_it_cannot_tell_is_unknown_not_wrong() -> None:
    # p4 never ran in the recording (superseded): whether p5 began the failure is unknown.
    tasks = [recorded(t, failed=n >= 5, ran=n != 4) for n, t in enumerate(PUSHES)]
    h = history(*tasks)
    out, s = run(h, on_claim("bisect"))
    assert [(f.culprit, f.last_good) for f in out.searches] == [(5, 4)]
    assert (s.wrong_culprits, s.culprits_unknown) == (0, 1)
    labels = [label for label, _ in report.table_rows(report.Report(h, (s,), 0.0))]
    assert labels.index("culprits unknown") == labels.index("culprits named wrongly") + 1
    synthetic = report.table_rows(report.Report(broken_from(5), (s,), 0.0))
    assert "culprits unknown" not in [label for label, _ in synthetic]


def test_a_failed_primary_alone_is_not_searched() -> None:
    h = history(dataclasses.replace(PUSHES[0], broken=True))
    out, s = run(h, on_claim("bisect"))
    assert out.state == [State.FAILED] and out.searches == [] and s.extra_runs == 0


def minutes_ms(n: float) -> int:
    return PUSHES[0].scheduled_ms + int(n * 60_000)


# -- configurations and policy files ------------------------------------------------------------
def test_configurations_name_the_worker_s_on_primary_failure() -> None:
    assert Config.parse("on-claim").name == "on-claim always"
    assert on_claim("supersede").name == "on-claim always, supersede"
    assert Config.parse("age=60,on-primary-failure=release").name == "on-claim age>60s, release"
    assert on_claim("bisect").on_failure is PrimaryFailure.BISECT
    confirmed = Config.parse("latest-wins,on-primary-failure=bisect,bisect-confirm=2")
    assert confirmed.name == "latest-wins, bisect confirm 2"
    [rule] = confirmed.policy().rules
    assert (rule.on_primary_failure, rule.bisect_confirm) == (PrimaryFailure.BISECT, 2)
    parked = Config.parse("latest-wins,on-primary-failure=bisect,hold-by=priority")
    assert parked.name == "latest-wins, bisect hold-by priority"
    [rule] = parked.policy().rules
    assert rule.hold_by is HoldBy.PRIORITY
    for bad in (
        "latest-wins,hold-by=priority",
        "on-claim,on-primary-failure=bisect,hold-by=priority",
        "latest-wins,on-primary-failure=release,hold-by=later",
        "on-claim,bisect-confirm=1",
        "latest-wins,bisect-confirm=1",
        "on-claim,on-primary-failure=later",
        "on-claim,on-primary-failure=bisect,on-primary-failure=release",
    ):
        with pytest.raises(InvalidInput):
            Config.parse(bad)


def test_policy_files_accept_bisect_with_bisect_confirm() -> None:
    doc = {
        "rules": [
            {
                "keys": "build.*",
                "strategy": "latest-wins",
                "on-primary-failure": "bisect",
                "bisect-confirm": 0,
            },
            {"keys": "test.*", "strategy": "latest-wins", "on-primary-failure": "bisect"},
        ]
    }
    policy = rules.parse(doc)
    first, second = policy.rules
    assert first.on_primary_failure is PrimaryFailure.BISECT and first.bisect_confirm == 0
    assert second.bisect_confirm == 3 and second.bisect_confidence == 0.99
    assert first.script_args()[6] == 2  # victims held until the primary ends, then searched
    assert "bisect confirm 0" in rules.describe(policy)[0]
    for bad in (
        {"on-primary-failure": "release", "bisect-confirm": 1},
        {"on-primary-failure": "bisect", "bisect-confirm": -1},
        {"on-primary-failure": "bisect", "bisect-confirm": True},
    ):
        rule = {"keys": "a", "strategy": "latest-wins", **bad}
        with pytest.raises(ConfigError, match="bisect-confirm"):
            rules.parse({"rules": [rule]})


# -- the report ---------------------------------------------------------------------------------
FAILING = [
    *("--hours", "12", "--pushes-per-hour", "20", "--build-workers", "3", "--test-workers", "3"),
    *("--regressions", "0.05", "--intermittent", "0.02"),
    *("--config", "on-claim,on-primary-failure=supersede"),
    *("--config", "on-claim,on-primary-failure=release"),
    *("--config", "on-claim,on-primary-failure=bisect"),
]
MODES = ["off", *(f"on-claim always, {m}" for m in ("supersede", "release", "bisect"))]
REFERENCES = ["linear backfill", "mozci's rule"]
FAILURE_LABELS = [label for label, _ in report.FAILURE_ROWS if label != report.UNKNOWN]


def replay_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "coalescer.cli", "replay", *args],
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_the_table_json_and_html_compare_the_three_modes(tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    done = replay_cli(*FAILING, "--html", str(page))
    assert done.returncode == 0, done.stderr
    lines = [re.split(r"\s{2,}", line.strip()) for line in done.stdout.splitlines()]
    assert lines[0] == MODES + REFERENCES
    rows = {line[0]: line[1:] for line in lines[2:] if line[0]}
    assert FAILURE_LABELS == [
        "regressions",
        "  seen failing",
        "  located to their push",
        "culprits named wrongly",
        "bisections",
        "extra runs",
        "rounds, most in one search",
        "failing run to culprit p50",
        "failing run to culprit p95",
    ]
    for label in ("regressions", "seen failing", "located to their push", "extra runs"):
        assert len(rows[label]) == 6, (label, rows[label])
    assert len(set(rows["regressions"])) == 1  # the same history under every mode
    assert rows["extra runs"][:2] == ["0", "0"] and int(rows["extra runs"][2]) > 0
    assert rows["bisections"][:3] == ["0", "0", "0"] and int(rows["bisections"][3]) > 0
    # The sheriffs work on supersede's failures: they see what it saw (and what their
    # backfills ran), and spend runs.
    assert rows["bisections"][4:] == ["-", "-"] and rows["tasks run"][4:] == ["-", "-"]
    assert all(int(n) >= int(rows["seen failing"][1]) for n in rows["seen failing"][4:])
    assert rows["rounds, most in one search"][4:] == ["1", "2"]
    assert "on the failures of on-claim always, supersede" in done.stdout

    doc = orjson.loads(replay_cli(*FAILING, "--json").stdout)
    figures = {c["name"]: c for c in doc["configurations"]}
    assert list(figures) == MODES
    for c in figures.values():
        assert {"regressions", "seen", "located", "extra_runs", "locate_p50_s"} <= set(c)
    assert figures["off"]["located"] >= figures[MODES[3]]["located"] > 0
    assert figures[MODES[3]]["extra_runs"] == int(rows["extra runs"][3])
    linear, mozci = doc["references"]
    assert (linear["name"], mozci["name"]) == tuple(REFERENCES)
    assert linear["base"] == mozci["base"] == MODES[1]
    assert linear["runs"] > 0 and linear["located"] >= figures[MODES[1]]["located"]
    assert linear["extra_runs"] == int(rows["extra runs"][4])

    html = page.read_text()
    for label in ("located to their push", "extra runs", "failing run to culprit p95"):
        assert f"<td>{label.strip()}</td>" in html.replace("<td>  ", "<td>")
    assert "<th>linear backfill</th><th>mozci&#39;s rule</th>" in html


def test_without_failures_the_report_keeps_its_rows(tmp_path: Path) -> None:
    done = replay_cli("--hours", "3", "--config", "on-claim")
    assert done.returncode == 0, done.stderr
    assert "extra runs" not in done.stdout and "regressions" not in done.stdout
    assert "linear backfill" not in done.stdout


# -- the enforcer's bisect (a policy file) --------------------------------------------------------
def bisect_policy(confirm: int = 0, parallel: int = 1, hold_by: str = "claim") -> Config:
    rule = {
        "keys": "k",
        "strategy": "latest-wins",
        "on-primary-failure": "bisect",
        "bisect-confirm": confirm,
        "bisect-parallel": parallel,
        "hold-by": hold_by,
    }
    return Config.from_policy(rules.parse({"rules": [rule]}, "test"), "bisect.yaml")


def held_behind_busy(culprit: int, priority: int = 0, workers: int = 1) -> History:
    """One worker, busy for an hour: p0..p8 arrive meanwhile (minutes 1-9), each held by the
    enforcer for the next; at 60 the worker runs p8, the primary (60-70). Broken from
    ``culprit`` on."""
    pushes = (
        dataclasses.replace(
            task(f"p{n}", n + 1, 10, order=n, key="k", priority=priority), broken=n >= culprit
        )
        for n in range(9)
    )
    return history(task("busy", 0, 60, key=None), *pushes, workers=workers)


#: Each task's fate in :func:`held_behind_busy` broken from p5, searched one run at a time.
FOUND_P5 = {
    "busy": ("completed", 60, ""),
    **{f"p{n}": ("superseded", 100, "p4") for n in range(3)},
    "p3": ("completed", 80, ""),
    "p4": ("completed", 100, ""),
    "p5": ("failed", 90, ""),
    **{f"p{n}": ("superseded", 100, "p5") for n in (6, 7)},
    "p8": ("failed", 70, ""),
}


@pytest.mark.usefixtures("redis_client")  # findings outlive the replay
def test_the_enforcer_s_bisect_locates_the_culprit_and_supersedes_the_rest() -> None:
    h = held_behind_busy(5)
    config = bisect_policy()
    out, s = run(h, config)
    # p8 fails at 70: the enforcer releases p3 (passes at 80), then p5 (fails at 90), then
    # p4 (passes at 100): p5 is the culprit, p4 the last good; no confirmation (bisect-confirm
    # 0).
    assert fates(h, out) == FOUND_P5
    ids = [t.task_id for t in h.tasks]
    assert out.searches == [
        Search(ids.index("p8"), ids.index("p5"), ids.index("p4"), T(70), T(100), 3, rounds=3)
    ]
    # Each probe is a released victim that ran again.
    assert [out.runs[ids.index(f"p{n}")] for n in range(9)] == [1, 1, 1, 2, 2, 2, 1, 1, 1]
    assert (s.extra_runs, s.bisections, s.regressions, s.located, s.wrong_culprits) == (
        3,
        1,
        1,
        1,
        0,
    )
    assert s.worker_hours == 100 / 60
    assert s.locate_p50_s == 30 * 60  # from p8's failure at 70 to the culprit at 100
    assert (s.wrong_winners, s.lost) == (0, 0)
    assert not any(state == State.HELD for state in out.state)


@pytest.mark.usefixtures("redis_client")  # findings outlive the replay
def test_victims_waiting_at_the_lowest_priority_are_probed_in_the_run_they_waited_in() -> None:
    # As above, the victims waiting unclaimed at the lowest priority (hold-by: priority, the
    # pushes' own priority "low"): the same search, the same fates, and no run given back.
    h = held_behind_busy(5, priority=priority_rank("low"))
    out, s = run(h, bisect_policy(hold_by="priority"))
    assert fates(h, out) == FOUND_P5
    ids = [t.task_id for t in h.tasks]
    assert [out.runs[ids.index(f"p{n}")] for n in range(9)] == [1] * 9
    assert (s.extra_runs, s.located, s.wrong_culprits, s.lost) == (3, 1, 0, 0)


@pytest.mark.usefixtures("redis_client")  # findings outlive the replay
def test_victims_idle_workers_ran_give_the_search_their_results() -> None:
    # Three workers: p0 and p1 run at once (1-11, 2-12); the others wait at the lowest
    # priority behind p8, the primary (11-21). The worker free at 12 takes the oldest waiting
    # victim, p2, then p3 at 22, p5 at 32: the search, from p8's failure at 21, probes p4 and
    # p6 (raised) and takes the others' results as they come, at no cost: p5 failed at 42 and
    # p4 passed, so p5 is the culprit at 42. The finding counts the 5 runs it took; 2 of them
    # were its own probes.
    h = held_behind_busy(5, priority=priority_rank("low"), workers=3)
    out, s = run(h, bisect_policy(hold_by="priority"))
    ids = [t.task_id for t in h.tasks]
    first = out.searches[0]
    assert (first.primary, first.culprit, first.last_good) == tuple(
        ids.index(p) for p in ("p8", "p5", "p4")
    )
    assert minutes(first.ended_ms) == 42 and first.runs == 5
    found = fates(h, out)
    assert [found[p] for p in ("p2", "p3")] == [("completed", 22, ""), ("completed", 32, "")]
    assert [out.runs[ids.index(p)] for p in ("p2", "p3", "p4", "p6")] == [1, 1, 1, 1]
    assert [found[p] for p in ("p4", "p6")] == [("completed", 31, ""), ("failed", 41, "")]
    assert (s.wrong_culprits, s.lost) == (0, 0)


@pytest.mark.usefixtures("redis_client")  # findings outlive the replay
@pytest.mark.parametrize(
    ("culprit", "probes", "good"),
    [(0, ["p3", "p1", "p0"], None), (8, ["p3", "p5", "p6", "p7"], "p7")],
)
def test_the_enforcer_s_bisect_at_either_end(culprit: int, probes: list[str], good: str) -> None:
    h = held_behind_busy(culprit)
    out, s = run(h, bisect_policy())
    ids = [t.task_id for t in h.tasks]
    found = fates(h, out)
    assert sorted(t for t, (state, _, by) in found.items() if state != "superseded") == sorted(
        ["busy", "p8", *probes]
    )
    stand_in = "p0" if culprit == 0 else good
    assert {by for state, _, by in found.values() if state == "superseded"} == {stand_in}
    [search] = out.searches
    assert search.culprit == ids.index(f"p{culprit}")
    assert search.last_good == (-1 if good is None else ids.index(good))
    assert search.runs == s.extra_runs == len(probes)


def T(n: float) -> int:
    return T0 + int(n * 60_000)


@pytest.mark.usefixtures("redis_client")  # findings outlive the replay
def test_the_enforcer_s_bisect_confirms_each_failure_it_narrows_on() -> None:
    h = held_behind_busy(5)
    out, s = run(h, bisect_policy(confirm=1))
    # p8 fails at 70 and runs again (rerunTask): fails at 80. p3 passes at 90; p5 fails at
    # 100, again at 110; p4 passes at 120: p5 is the culprit, p4 the last good.
    assert fates(h, out) == {
        "busy": ("completed", 60, ""),
        **{f"p{n}": ("superseded", 120, "p4") for n in range(3)},
        "p3": ("completed", 90, ""),
        "p4": ("completed", 120, ""),
        "p5": ("failed", 110, ""),
        **{f"p{n}": ("superseded", 120, "p5") for n in (6, 7)},
        "p8": ("failed", 80, ""),
    }
    ids = [t.task_id for t in h.tasks]
    assert out.searches == [
        Search(ids.index("p8"), ids.index("p5"), ids.index("p4"), T(70), T(120), 5, rounds=5)
    ]
    # A probe is a released victim that ran again; a confirmation, one more run.
    assert [out.runs[ids.index(f"p{n}")] for n in range(9)] == [1, 1, 1, 2, 2, 3, 1, 1, 2]
    assert (s.extra_runs, s.bisections, s.located, s.wrong_culprits) == (5, 1, 1, 0)
    assert not any(state == State.HELD for state in out.state)


@pytest.mark.usefixtures("redis_client")  # findings outlive the replay
def test_a_policy_file_with_bisect_confirms_failures(tmp_path: Path) -> None:
    policy = tmp_path / "bisect.yaml"
    policy.write_text(
        "rules:\n  - keys: build.*\n    strategy: latest-wins\n"
        "    on-primary-failure: bisect\n    bisect-confirm: 1\n"
    )
    busy = ("--hours", "12", "--pushes-per-hour", "20", "--build-workers", "1")
    done = replay_cli(*busy, "--regressions", "0.1", "--policy", str(policy), "--json")
    assert done.returncode == 0, done.stderr
    assert "trusting failures" not in done.stderr
    assert "released when the primary fails" not in done.stderr
    doc = orjson.loads(done.stdout)
    [_, bisected] = doc["configurations"]
    assert bisected["bisections"] > 0 and bisected["extra_runs"] > 0
    assert bisected["located"] > 0
