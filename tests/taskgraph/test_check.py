"""``coalescer policy check --taskgraph``: a graph real taskgraph generated, read against a
policy, says per key which rule governs it and whether its tasks will be superseded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coalescer.cli import main
from tests.taskgraph.support import Project

POLICY = """
rules:
  - name: tests
    keys: "example-ci.test.**"
    strategy: latest-wins
"""


@pytest.fixture(autouse=True)
def _no_environment_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COALESCER_POLICY_FILE", raising=False)
    monkeypatch.delenv("COALESCER_ROUTE_PREFIX", raising=False)


def test_each_key_with_its_rule_and_fate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    graph = tmp_path / "full.json"
    graph.write_text(json.dumps(Project(tmp_path / "example").generate()))
    policy = tmp_path / "policy.yml"
    policy.write_text(POLICY)
    assert main(["policy", "check", str(policy), "--taskgraph", str(graph)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("tests: example-ci.test.** -> latest-wins")
    assert lines[1] == (
        f"{graph}: 5 tasks, 4 under 4 coalescing keys (coalesce.v1.*), 1 without: signing-linux64"
    )
    assert sorted(lines[2:]) == [
        "example-ci.build.build-linux64.debug: default (on-claim): superseded when a worker "
        "claims one (each names supersederUrl) [build-linux64/debug]",
        "example-ci.build.build-linux64: default (on-claim): superseded when a worker claims one "
        "(each names supersederUrl) [build-linux64]",
        "example-ci.test.test-lint: tests (latest-wins): superseded on arrival by "
        "`coalescer enforce` [test-lint]",
        "example-ci.test.test-unit: tests (latest-wins): superseded on arrival by "
        "`coalescer enforce` [test-unit]",
    ]
    # Without a policy, the tests' keys (route only) are never superseded: the check says so.
    assert main(["policy", "check", "--taskgraph", str(graph)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("no rules: every key keeps on-claim\n")
    assert (
        "example-ci.test.test-unit: default (on-claim): never superseded: no supersederUrl, and "
        "no rule decides on arrival [test-unit]"
    ) in out


def test_a_file_that_is_not_a_graph_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.json"
    assert main(["policy", "check", "--taskgraph", str(missing)]) == 2
    assert capsys.readouterr().err == f"coalescer: task graph {str(missing)!r} not found\n"
    labels = tmp_path / "labels.json"
    labels.write_text('["build-linux64", "test-unit"]')
    assert main(["policy", "check", "--taskgraph", str(labels)]) == 2
    err = capsys.readouterr().err
    assert "is not `taskgraph full --json` output" in err and err.count("\n") == 1
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    assert main(["policy", "check", "--taskgraph", str(broken)]) == 2
    assert "is not JSON" in capsys.readouterr().err


def test_tasks_of_one_graph_sharing_a_key_are_pointed_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def task(label: str) -> dict[str, object]:
        return {"label": label, "task": {"routes": ["coalesce.v1.p.test"], "payload": {}}}

    graph = tmp_path / "full.json"
    graph.write_text(json.dumps({"test-a": task("test-a"), "test-b": task("test-b")}))
    assert main(["policy", "check", "--taskgraph", str(graph)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "p.test: default (on-claim): never superseded: no supersederUrl, and no rule decides on "
        "arrival; 2 tasks of this graph share it and would supersede each other [test-a, test-b]"
    )
