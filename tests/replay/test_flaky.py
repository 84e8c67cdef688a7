"""Flaky tests and flaky regressions in synthetic histories: chosen from seeded streams of
their own, at the shares asked for, drawn per run the same way by the pool and by anyone who
asks :meth:`History.fails`; a history without them is the one it was."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import defaultdict

import pytest

from coalescer.cli import main
from coalescer.errors import InvalidInput
from coalescer.replay.history import History
from coalescer.replay.metrics import regressions
from coalescer.replay.pool import Pool, State
from coalescer.replay.synthetic import FLAKY_REGRESSION_RATES, Synthetic, generate
from tests.replay.support import history, task

BASE = Synthetic(hours=24, regression_rate=0.05, intermittent_rate=0.02, seed=2)


def test_flaky_options_leave_the_tasks_and_the_broken_pushes_as_they_were() -> None:
    plain = generate(BASE)
    flaky = generate(dataclasses.replace(BASE, flaky_share=0.25, flaky_rate=0.1))
    both = generate(
        dataclasses.replace(BASE, flaky_share=0.25, flaky_rate=0.1, flaky_regressions=0.5)
    )
    assert plain.tasks == flaky.tasks == both.tasks
    assert (plain.flaky, plain.broken_rates) == ({}, {})
    assert plain.source == (
        "synthetic (seed 2; regressions 0.05 a push, fixed within 3; intermittent 0.02 a run)"
    )
    assert flaky.source.endswith("; flaky: 2 keys at 0.1 a run, 0 of regressions)")
    assert flaky.flaky == both.flaky and both.broken_rates and not flaky.broken_rates


@pytest.mark.parametrize(("share", "count"), [(0.25, 2), (0.5, 4), (0.01, 1), (1.0, 8)])
def test_that_share_of_the_keys_is_flaky_chosen_by_the_seed(share: float, count: int) -> None:
    h = generate(dataclasses.replace(BASE, flaky_share=share, flaky_rate=0.3))
    assert len(h.flaky) == count and set(h.flaky.values()) == {0.3}
    assert set(h.flaky) <= {k for t in h.tasks for k in t.keys}
    again = generate(dataclasses.replace(BASE, flaky_share=share, flaky_rate=0.3))
    assert again.flaky == h.flaky
    chosen = {
        tuple(generate(Synthetic(hours=2, seed=seed, flaky_share=0.25, flaky_rate=0.1)).flaky)
        for seed in range(8)
    }
    assert len(chosen) > 1  # another seed, other keys


def test_that_share_of_the_regressions_fails_only_some_runs_each_at_its_own_rate() -> None:
    spec = Synthetic(
        hours=72, pushes_per_hour=30, regression_rate=0.08, flaky_regressions=0.4, seed=1
    )
    h = generate(spec)
    found = regressions(h)
    ids = [t.task_id for t in h.tasks]
    flaky = [r for r in found if ids[r[0]] in h.broken_rates]
    assert len(found) > 500
    assert abs(len(flaky) / len(found) - 0.4) < 0.05
    low, high = FLAKY_REGRESSION_RATES
    assert all(low <= rate <= high for rate in h.broken_rates.values())
    rates = list(h.broken_rates.values())
    assert abs(sum(rates) / len(rates) - 0.5) < 0.03  # drawn uniformly between 0.3 and 0.7
    # The pushes of one breakage share its rate (back to back breakages read as one).
    one_rate = [
        len({h.broken_rates.get(ids[j], 1.0) for j in broken}) == 1 for _, _, broken in found
    ]
    assert sum(one_rate) / len(one_rate) > 0.9


def flake_history(**changes: object) -> History:
    tasks = [task(f"t{n}", n, 1, key=f"k{n % 4}") for n in range(4000)]
    return dataclasses.replace(history(*tasks, workers=50), **changes)  # type: ignore[arg-type]


def test_draws_are_the_same_for_the_same_seed_task_and_run_and_differ_otherwise() -> None:
    h = flake_history(intermittent=0.1, flaky={"k0": 0.5})
    t = h.tasks[0]
    assert [h.fails(t, run, 7) for run in range(1, 50)] == [
        h.fails(t, run, 7) for run in range(1, 50)
    ]
    draws = {(seed, run): h.fails(t, run, seed) for seed in range(20) for run in range(1, 20)}
    assert len(set(draws.values())) == 2


def test_a_flaky_key_fails_its_rate_on_top_of_the_intermittent_failures() -> None:
    plain = flake_history(intermittent=0.05)
    flaky = flake_history(intermittent=0.05, flaky={"k0": 0.2, "k1": 0.2})
    share: dict[str, list[bool]] = defaultdict(list)
    for t in flaky.tasks:
        failed, before = flaky.fails(t, 1, 0), plain.fails(t, 1, 0)
        assert failed or not before  # every intermittent failure stays; flaky ones are added
        share[t.keys[0]].append(failed)
    rate = {key: sum(fails) / len(fails) for key, fails in share.items()}
    expected = 1 - 0.95 * 0.8
    assert abs(rate["k0"] - expected) < 0.035 and abs(rate["k1"] - expected) < 0.035
    assert abs(rate["k2"] - 0.05) < 0.02 and abs(rate["k3"] - 0.05) < 0.02


def test_a_flaky_regression_fails_its_share_of_runs_and_a_steady_one_every_run() -> None:
    tasks = [dataclasses.replace(task(f"t{n}", n, 1), broken=True) for n in range(2000)]
    h = dataclasses.replace(history(*tasks), broken_rates={f"t{n}": 0.4 for n in range(0, 2000, 2)})
    flaky = [h.fails(t, run, 0) for t in h.tasks[::2] for run in (1, 2)]
    steady = [h.fails(t, run, 0) for t in h.tasks[1::2] for run in (1, 2)]
    assert all(steady)
    assert abs(sum(flaky) / len(flaky) - 0.4) < 0.03


def test_the_pool_draws_what_the_history_says() -> None:
    h = flake_history(intermittent=0.02, flaky={"k0": 0.3})
    out = asyncio.run(Pool(h, None, seed=3).run())
    assert [s == State.FAILED for s in out.state] == [h.fails(t, 1, 3) for t in h.tasks]
    assert out.executions == [1] * len(h.tasks)
    assert 0.05 < out.state.count(State.FAILED) / len(h.tasks) < 0.12


def test_bad_flaky_shares_are_refused() -> None:
    for bad in ({"flaky_share": 1.5}, {"flaky_rate": -0.1}, {"flaky_regressions": 2.0}):
        with pytest.raises(InvalidInput, match="between 0 and 1"):
            Synthetic(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--flaky", "0.25"], "--flaky '0.25': expected SHARE:RATE"),
        (["--flaky", "a:0.1"], "--flaky 'a:0.1': expected SHARE:RATE"),
        (["--flaky", "0.25:1.5"], "two numbers between 0 and 1"),
        (["--flaky-regressions", "-0.5"], "flaky_regressions must be between 0 and 1"),
    ],
)
def test_bad_flaky_options_exit_2_with_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", "--hours", "1", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
