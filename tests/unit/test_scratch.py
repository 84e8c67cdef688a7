"""Scratch directories: what a killed process left is removed by the next one, nothing else."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from coalescer import scratch


@pytest.fixture
def tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_dead_process_s_directory_goes_and_the_others_stay(tmp: Path) -> None:
    host = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())
    dead, alive = dead_pid(), os.getpid()
    for name in (
        f"coalescer-task-{dead}@{host}-abc",  # left by a killed process of this host
        f"coalescer-task-{alive}@{host}-def",  # a process still running
        f"coalescer-task-{dead}@elsewhere-ghi",  # another host's, sharing the folder
        f"coalescer-metrics-{dead}@{host}-jkl",  # another prefix
        "coalescer-task-unnamed",  # not one of ours
    ):
        (tmp / name).mkdir()
        (tmp / name / "state").write_text("x")
    made = scratch.make("coalescer-task-")
    left = sorted(p.name for p in tmp.iterdir())
    assert f"coalescer-task-{dead}@{host}-abc" not in left
    assert len(left) == 5 and made.name in left
    assert made.name.startswith(f"coalescer-task-{alive}@{host}-")


def test_a_directory_is_removed_at_the_end_of_its_use(tmp: Path) -> None:
    with scratch.directory("coalescer-task-") as path:
        (path / "output").write_text("x")
    assert not path.exists()
    assert list(tmp.iterdir()) == []
