"""The queue's lags read from a history's runs (:mod:`coalescer.replay.lags`)."""

from __future__ import annotations

import asyncio
import dataclasses

from coalescer.replay.lags import Run, claim_waits, hold_times
from coalescer.replay.pool import Pool, State
from tests.replay.support import MIN, history, minutes, task

W = ("q", "wg/w1")


def test_a_claim_waits_from_pending_or_from_the_worker_s_previous_run() -> None:
    runs = [
        Run("a", 0, ("k",), W, pending=0, started=100, resolved=1000, reason="completed"),
        # Pending before a ended: claimed 40 ms after the worker freed.
        Run("b", 0, ("k",), W, pending=500, started=1040, resolved=2000, reason="completed"),
        # Pending while the worker waited in claimWork: the queue's poll, 700 ms.
        Run("c", 0, ("k",), W, pending=2300, started=3000, resolved=4000, reason="completed"),
    ]
    # The worker's first run says nothing of how long it waited.
    assert claim_waits(runs) == [("b", 0, 40, False), ("c", 0, 700, True)]


def test_a_shim_s_hold_runs_from_its_first_claim_to_its_primary_s_run() -> None:
    runs = [
        # The worker claims a, asks, holds b and runs c, the newest, 120 ms after a's claim.
        Run("a", 0, ("k",), W, pending=0, started=1000, resolved=9000, reason="canceled"),
        Run("b", 0, ("k",), W, pending=0, started=1060, resolved=9000, reason="canceled"),
        Run("c", 0, ("k",), W, pending=0, started=1120, resolved=8000, reason="completed"),
        # Another key's run on the same worker, later: held nothing.
        Run("d", 0, ("j",), W, pending=0, started=9100, resolved=9900, reason="completed"),
    ]
    assert hold_times(runs) == {"c": 120}


def test_a_task_canceled_while_its_worker_claims_it_frees_the_worker_then() -> None:
    """a's worker frees at 10 min; b, pending, is claimed its recorded wait later (a minute
    here), but a person canceled it meanwhile: the worker takes c once its claim is over."""
    first = task("a", 0, 10)
    waiting = dataclasses.replace(task("b", 1, 10, canceled=10.5), wait_ms=MIN)
    last = task("c", 2, 10)
    out = asyncio.run(Pool(history(first, waiting, last), None).run())
    assert out.state[1] == State.WITHDRAWN and out.worked_ms[1] == 0
    assert minutes(out.left_ms[2]) == 11 and minutes(out.resolved_ms[2]) == 21


def test_a_claim_s_wait_delays_the_run_and_the_worker_s_question() -> None:
    """b is claimed a minute after a ends (its recorded wait): it runs from then."""
    first = task("a", 0, 10)
    waiting = dataclasses.replace(task("b", 1, 10), wait_ms=MIN)
    out = asyncio.run(Pool(history(first, waiting), None).run())
    assert minutes(out.resolved_ms[1]) == 21 and out.worker_ms == 20 * MIN
