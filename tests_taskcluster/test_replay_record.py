"""The replay's real-queue recording (``scripts/record_history.py``): one scenario recorded on
the deployment, saved as ``coalescer replay --task-group --save`` saves it, replays what
happened under the configuration that was on."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest

from coalescer.replay import recorded, sources
from coalescer.replay.runner import Config
from tests.replay.test_live_runs import final, replayed
from tests.replay.test_real_queue import TOLERANCE, happened, run

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).parent.parent / "scripts" / "record_history.py"


async def test_a_pool_started_after_the_pushes_is_recorded_and_replayed(
    tmp_path: Path,
) -> None:
    spec = importlib.util.spec_from_file_location("record_history", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    saved = await script.record("late-pool", tmp_path)
    answers = recorded.Answers.load(saved)
    queue, evidence, groups = recorded.replaying(answers)
    assert answers.prefix is not None
    history = sources.from_task_groups(
        queue, groups, prefix=answers.prefix, rank_tag=None, evidence=evidence
    )
    lived = happened(history)
    # Each of the two workers ran the newest of its five pushes; the others superseded.
    assert sorted(w.split()[0] for w in lived.values()) == ["ran"] * 2 + ["superseded"] * 8
    [on] = await asyncio.to_thread(run, history, Config(True))
    assert final(replayed(history, on)) == final(lived)
    seen = history.recorded()
    assert seen is not None
    makespan = max(on.resolved_ms) - history.tasks[0].scheduled_ms
    assert abs(makespan - seen.makespan_ms) <= TOLERANCE * seen.makespan_ms
    assert (tmp_path / "late-pool.events.jsonl").stat().st_size > 0
