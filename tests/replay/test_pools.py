"""Pools that follow the history: a queue's workers come and go as the recorded runs show
(each worker from its first claim to its last resolution), and the replay's pool with them."""

from __future__ import annotations

import asyncio

import orjson

from coalescer.replay.capacity import curves
from coalescer.replay.history import History
from coalescer.replay.metrics import summarize
from coalescer.replay.pool import Pool
from coalescer.replay.report import Report, pools, table
from coalescer.replay.sources import from_events, read_events
from tests.replay.recording import iso, message
from tests.replay.support import MIN, T0

#: Minutes at which each worker of the pool first claimed: one, then three more came.
ARRIVALS = (0, 20, 30, 40)


def grown() -> tuple[list[bytes], dict[str, int]]:
    """Twelve 10-minute tasks a minute apart on a pool that grew from 1 worker to 4: the
    messages, and each task's recorded start (ms)."""
    free = [T0 + m * MIN for m in ARRIVALS]
    lines, started = [], {}
    for n in range(12):
        scheduled = T0 + n * MIN
        task = {
            "id": f"{n:04d}AAAAQAC" + "A" * 11,
            "queue": "proj/linux",
            "key": "build",
            "scheduled": scheduled,
        }
        w = min(range(len(free)), key=lambda w: (max(free[w], scheduled), w))
        start = max(free[w], scheduled)
        free[w] = start + 10 * MIN
        started[task["id"]] = start
        run = {"runId": 0, "reasonCreated": "scheduled", "scheduled": iso(scheduled)}
        claimed = {**run, "workerGroup": "wg", "workerId": f"w{w}", "takenUntil": iso(free[w])}
        lines += [
            orjson.dumps(message("pending", task, {**run, "state": "pending"})),
            orjson.dumps(
                message("running", task, {**claimed, "state": "running", "started": iso(start)})
            ),
            orjson.dumps(
                message(
                    "completed",
                    task,
                    {
                        **claimed,
                        "state": "completed",
                        "started": iso(start),
                        "resolved": iso(free[w]),
                        "reasonResolved": "completed",
                    },
                )
            ),
        ]
    return lines, started


def read(**workers: int) -> History:
    lines, _ = grown()
    return from_events(
        read_events(lines), prefix="coalesce.v1", rank_tag=None, workers=workers or None
    )


def test_each_worker_counts_from_its_first_claim_to_its_last_resolution() -> None:
    runs = [
        ("q", "a", 0, 10),
        ("q", "a", 10, 30),
        ("q", "b", 5, 15),
        ("q", "c", 15, None),  # still running when recorded: stays
        ("r", "a", 0, 10),  # the same name on another queue is another worker
    ]
    # At 15, b leaves as c comes: still two.
    assert curves(runs) == {"q": ((0, 1), (5, 2), (30, 1)), "r": ((0, 1), (10, 0))}


def test_a_pool_that_grew_from_one_worker_to_four_is_replayed_as_it_grew() -> None:
    history = read()
    _, started = grown()
    assert history.workers == {"proj/linux": 4} and history.sized == {"proj/linux": "history"}
    curve = history.curves["proj/linux"]
    assert [(at - T0) // MIN for at, _ in curve[:4]] == list(ARRIVALS)
    assert [level for _, level in curve[:4]] == [1, 2, 3, 4]
    out = asyncio.run(Pool(history, None).run())
    # Every task starts when it really started: the workers came when they came.
    assert {t.task_id: out.left_ms[i] for i, t in enumerate(history.tasks)} == started
    summary = summarize(history, "off", out, None)
    recorded = history.recorded()
    assert recorded is not None
    assert summary.makespan_hours * 3_600_000 == recorded.makespan_ms
    line = pools(history)
    assert line == ("workers: proj/linux 1-4 over time, as the history's workers came and went")
    assert line in table(Report(history, (summary,), 0.0))


def test_workers_given_for_a_queue_override_its_curve() -> None:
    history = read(**{"proj/linux": 4})
    assert history.sized == {"proj/linux": "given"} and history.curves == {}
    out = asyncio.run(Pool(history, None).run())
    # Four workers from the start: the first four tasks start at once, as they are pending.
    firsts = sorted(out.left_ms)[:4]
    assert [(at - T0) // MIN for at in firsts] == [0, 1, 2, 3]
    assert pools(history) == "workers: proj/linux 4 (--workers)"
    assert Report(history, (), 0.0).history_json()["pools"]["proj/linux"]["sizedBy"] == "given"
