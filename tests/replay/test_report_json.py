"""The report's JSON keeps full precision: short histories are checked to the millisecond."""

from __future__ import annotations

import asyncio
import dataclasses

from coalescer.replay.metrics import summarize
from coalescer.replay.pool import Pool
from coalescer.replay.report import Report
from tests.replay.support import T0, history, task


def test_json_hours_are_not_rounded() -> None:
    h = history(task("a", 0, 0.05, key="x"), task("b", 0, 0.07, key="y"), workers=2)
    first = h.tasks[0]
    real = ((first.scheduled_ms, first.scheduled_ms + 1_234),)
    h = dataclasses.replace(h, tasks=(dataclasses.replace(first, real_runs=real), *h.tasks[1:]))
    out = asyncio.run(Pool(h, None).run())
    summary = summarize(h, "off", out, None)
    doc = Report(h, (summary,), 0.0).to_json()
    [off] = doc["configurations"]
    assert off["worker_hours"] == (3_000 + 4_200) / 3_600_000
    assert off["makespan_hours"] == 4_200 / 3_600_000
    assert doc["history"]["recorded"]["workerHours"] == 1_234 / 3_600_000
    assert doc["history"]["recordedMakespanHours"] == 1_234 / 3_600_000
    assert off["backlog"][0][0] == (out.backlog[0][0] - T0) / 3_600_000
