"""The opt-in real-Taskcluster layer refuses to start without its deployment, in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests_taskcluster.environment import from_environ, problem

ROOT = Path(__file__).resolve().parents[2]
FULL = {
    "TASKCLUSTER_ROOT_URL": "https://tc.example.com/",
    "TASKCLUSTER_CLIENT_ID": "project/coalescer/ci",
    "TASKCLUSTER_ACCESS_TOKEN": "secret",
    "PULSE_URL": "amqps://coalescer:pw@pulse.example.com:5671/",
}


def test_every_missing_variable_is_named() -> None:
    message = problem({"TASKCLUSTER_ROOT_URL": "https://tc.example.com"})
    assert message is not None
    for name in ("TASKCLUSTER_CLIENT_ID", "TASKCLUSTER_ACCESS_TOKEN", "PULSE_URL"):
        assert name in message
    assert "TASKCLUSTER_ROOT_URL" not in message


def test_a_pulse_url_must_be_amqp() -> None:
    assert problem(FULL | {"PULSE_URL": "http://pulse"}) == (
        "PULSE_URL must start with amqp:// or amqps://"
    )


def test_a_complete_environment_describes_the_deployment() -> None:
    assert problem(FULL) is None
    deployment = from_environ(FULL)
    assert deployment.root_url == "https://tc.example.com"
    assert deployment.pulse_user == "coalescer"
    assert deployment.redis_url is None


def test_the_check_exits_2_with_one_line() -> None:
    env = {k: v for k, v in os.environ.items() if k not in FULL}
    done = subprocess.run(
        [sys.executable, "-m", "tests_taskcluster.environment"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    [line] = done.stderr.splitlines()
    assert line.startswith("make test-taskcluster: the real-Taskcluster tests need TASKCLUSTER_")
