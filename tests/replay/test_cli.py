"""``coalescer replay`` end to end, as a process: the table, the JSON and the HTML report of a
small synthetic history, on real Redis and on the embedded store; bad arguments exit 2 with
a one-line message."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from coalescer.cli import main
from coalescer.errors import InvalidInput
from coalescer.replay.runner import Config
from tests.conftest import REDIS_URL

pytestmark = pytest.mark.integration

SMALL = ["--hours", "12", "--pushes-per-hour", "10", "--build-workers", "3", "--test-workers", "4"]


def replay(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "coalescer.cli", "replay", *args],
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_json_and_html_reports_of_a_synthetic_history(tmp_path: Path) -> None:
    html = tmp_path / "report.html"
    done = replay(
        *SMALL,
        "--config",
        "age=1800,size=2",
        "--config",
        "on-claim",
        "--redis-url",
        REDIS_URL,
        "--json",
        "--html",
        str(html),
    )
    assert done.returncode == 0, done.stderr
    doc = orjson.loads(done.stdout)
    off, threshold, always = doc["configurations"]
    assert [c["name"] for c in doc["configurations"]] == [
        "off",
        "on-claim age>1800s size>2",
        "on-claim always",
    ]
    assert doc["history"]["tasks"] == off["tasks"] > 100
    for c in doc["configurations"]:
        assert c["wrong_winners"] == 0 and c["lost"] == 0
        assert (
            c["run"] + c["superseded"] + c["never_scheduled"] + c["deadline_exceeded"] == c["tasks"]
        )
        assert len(c["keys"]) == 8 and c["backlog"]
    assert off["superseded"] == 0 and off["saved_hours"] == 0 and off["asked"] == 0
    assert always["superseded"] > threshold["superseded"] > 0
    assert always["saved_hours"] > threshold["saved_hours"] > 0
    assert always["worker_hours"] + always["saved_hours"] == pytest.approx(off["worker_hours"])
    assert always["backlog_peak"] < off["backlog_peak"]

    page = html.read_text()
    assert "<script" not in page
    assert page.count("<svg") == 3
    assert page.count("<polyline") == 2 * 3  # backlog and time to result, per configuration
    for name in ("off", "on-claim age&gt;1800s size&gt;2", "on-claim always"):
        assert name in page


def test_the_table_on_the_embedded_store() -> None:
    done = replay("--hours", "4", "--pushes-per-hour", "6", "--config", "age=600,size=1")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["off", "on-claim", "age>600s", "size>1"]
    rows = {line[:27].strip(): line[27:].split() for line in lines[2:19]}
    assert rows["wrong winners (must be 0)"] == ["0", "0"]
    assert rows["lost tasks (must be 0)"] == ["0", "0"]
    assert rows["superseded"][0] == "0"
    assert any(line.startswith("build.p1 ") for line in lines)
    assert "EMBEDDED" not in done.stderr  # the production warning would only mislead here


POLICY = """\
rules:
  - name: builds
    keys: "build.*"
    strategy: latest-wins
    supersede-running: true
    protect-running-after: 10m
  - name: tests
    keys: "test.p1.*"
    strategy: first-wins
    on-primary-failure: release
"""


def test_a_policy_file_replayed_per_key_and_reported_per_rule(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    html = tmp_path / "report.html"
    args = [*SMALL, "--build-workers", "2", "--policy", str(policy)]
    done = replay(*args, "--json", "--html", str(html))
    assert done.returncode == 0, done.stderr
    off, file = orjson.loads(done.stdout)["configurations"]
    assert file["name"] == "policy policy.yaml"
    assert file["wrong_winners"] == 0 and file["lost"] == 0
    assert file["asked"] > 0  # test.p2.* has no rule: its workers ask on claim
    rules = {r["rule"]: r for r in file["rules"]}
    assert {(n, r["strategy"]) for n, r in rules.items()} == {
        ("builds", "latest-wins"),
        ("tests", "first-wins"),
        ("default", "on-claim"),
    }
    assert sum(r["tasks"] for r in rules.values()) == file["tasks"]
    assert sum(r["superseded"] for r in rules.values()) == file["superseded"]
    assert rules["builds"]["superseded"] > 0 and rules["builds"]["saved_hours"] > 0
    assert sum(r["worker_hours"] for r in rules.values()) == pytest.approx(
        file["worker_hours"], abs=0.01
    )
    assert {r["rule"] for r in off["rules"]} == {"default"}
    page = html.read_text()
    assert "Per rule: policy policy.yaml" in page and "builds (latest-wins)" in page

    table = replay(*args)
    assert table.returncode == 0, table.stderr
    assert "rules of policy policy.yaml" in table.stdout
    assert any(line.startswith("tests (first-wins) ") for line in table.stdout.splitlines())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--config", "age=soon"], "bad configuration 'age=soon'"),
        (["--workers", "q=0"], "--workers 'q=0'"),
        (["--events", "/nonexistent.jsonl"], "cannot read /nonexistent.jsonl"),
        (["--hours", "0"], "synthetic hours must be positive"),
        (["--policy", "/nonexistent.yaml"], "--policy '/nonexistent.yaml': no such file"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("off", "off"),
        ("on-claim", "on-claim always"),
        ("age=3600,size=5", "on-claim age>3600s size>5"),
        ("on-claim, size=2", "on-claim size>2"),
        ("latest-wins", "latest-wins"),
        ("latest-wins,age=600", "latest-wins age>600s"),
        ("first-wins, size=0", "first-wins size>0"),
    ],
)
def test_configurations_are_named_by_what_they_do(text: str, name: str) -> None:
    assert Config.parse(text).name == name


@pytest.mark.parametrize("text", ["age=1,age=2", "latest", "off,size=1", "size=-1", ""])
def test_malformed_configurations_are_refused(text: str) -> None:
    with pytest.raises(InvalidInput, match="bad configuration"):
        Config.parse(text)


def test_one_hour_replays_the_mornings_pushes() -> None:
    done = replay("--hours", "1")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split()[0] == "off"
    rows = {line[:27].strip(): line[27:].split() for line in lines[2:19]}
    assert int(rows["tasks run"][0]) > 40
    assert rows["lost tasks (must be 0)"] == ["0", "0", "0"]
    assert any(line.startswith("test.p2.s3 ") for line in lines)


def test_a_synthetic_history_without_a_push_exits_2_saying_what_to_give(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["replay", "--hours", "0.5", "--pushes-per-hour", "0.01"]) == 2
    err = capsys.readouterr().err
    assert "drew no push in its 0.5 h from 09:30 UTC" in err
    assert "give more --hours or --pushes-per-hour" in err and "Traceback" not in err
