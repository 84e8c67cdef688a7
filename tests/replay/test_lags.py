"""The queue's lags read from a history's runs (:mod:`coalescer.replay.lags`)."""

from __future__ import annotations

from coalescer.replay.lags import Run, claim_waits, hold_times

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
