"""The chaos soak for one minute (``make soak`` runs it for ten): the real processes under
random store, broker and process faults and abusive clients, then every invariant checked.

The faults' seed is fixed (:data:`SEED`), so that ``make test`` draws the same faults each run
and a failure reruns as it happened:
``python -m tests.soak --duration 60 --settle 25 --seed 1179``. Other seeds: ``make soak``, and
``make soak-check`` runs this same soak on each of the bugs of ``tests/soak/mutants.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
#: The faults' seed: fixed, as every seed in ``make test`` is; a run whose faults hit the store
#: (emptied, frozen, full), a worker, the broker and the service.
SEED = 1179


@pytest.mark.timeout(450)
def test_a_minute_of_chaos_ends_with_no_invariant_violated(amqp_url: str, tmp_path: Path) -> None:
    seed = SEED
    env = {**os.environ, "COALESCER_TEST_AMQP_URL": amqp_url}
    argv = ["--duration", "60", "--settle", "25", "--seed", str(seed), "--report", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, "-m", "tests.soak", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    report = json.loads((tmp_path / "report.json").read_text())
    summary = report["summary"]
    assert done.returncode == 0 and not report["violations"], (
        f"seed {seed}:\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
    )
    assert summary["faults"] >= 5 and summary["tasks"] >= 100, summary
    assert summary["tasks by state"].get("completed", 0) > 0, summary
