"""Recorded Pulse messages as a history; replayed without superseding, the recorded makespan
comes back (within 1%: the recording's claims wait for a tick and a poll of up to 4 s)."""

from __future__ import annotations

import asyncio
import random

import orjson
import pytest

from coalescer.replay.metrics import summarize
from coalescer.replay.pool import Pool
from coalescer.replay.sources import SourceError, from_events, read_events
from tests.replay.recording import record

TOLERANCE = 0.01


def test_a_replay_without_superseding_reproduces_the_recorded_makespan() -> None:
    lines, makespan_ms = record(count=400, workers=3)
    random.Random(7).shuffle(lines)  # a recording's order changes nothing
    history = from_events(read_events(lines), prefix="coalesce.v1", rank_tag=None)
    assert len(history.tasks) == 400
    assert history.workers == {"proj/linux": 3, "proj/mac": 3}  # the recorded peak
    assert history.recorded_makespan_ms() == makespan_ms
    out = asyncio.run(Pool(history, None).run())
    replayed = summarize(history, "off", out, None).makespan_hours * 3_600_000
    assert abs(replayed - makespan_ms) <= TOLERANCE * makespan_ms
    assert sum(t.duration_ms or 0 for t in history.tasks) == out.worker_ms
    # Each task starts within 5 minutes of its recorded start (the poll delays add up).
    assert max(abs(out.left_ms[i] - t.started_ms) for i, t in enumerate(history.tasks)) < 300_000


def test_unreadable_recordings_are_refused_with_the_line() -> None:
    lines, _ = record(count=2, workers=1)
    with pytest.raises(SourceError, match="line 2: "):
        list(read_events([lines[0], b"{not json", *lines[1:]]))
    broken = orjson.loads(lines[0])
    del broken["payload"]["status"]["deadline"]
    with pytest.raises(SourceError, match="task-pending message fails its schema"):
        from_events(read_events([orjson.dumps(broken)]), prefix="coalesce.v1", rank_tag=None)
