"""Real taskgraph generates the example project's graph with coalescer's transforms: the routes
and docker-worker's supersederUrl where they belong, nothing on signing, no per-push part in a
key, and one line naming kind and label when a key cannot be made."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.taskgraph.support import Project, routes

URL = "https://coalescer.example.com"


@pytest.fixture
def project(tmp_path: Path) -> Project:
    return Project(tmp_path / "example")


def test_builds_get_route_and_superseder_url_tests_the_route_signing_nothing(
    project: Project,
) -> None:
    graph = project.generate()
    assert routes(graph) == {
        "build-linux64": ["coalesce.v1.example-ci.build.build-linux64"],
        "build-linux64/debug": ["coalesce.v1.example-ci.build.build-linux64.debug"],
        "test-unit": ["coalesce.v1.example-ci.test.test-unit"],
        "test-lint": ["coalesce.v1.example-ci.test.test-lint"],
        "signing-linux64": [],
    }
    payloads = {label: task["task"]["payload"] for label, task in graph.items()}
    assert payloads["build-linux64"]["supersederUrl"] == (
        f"{URL}/v1/docker-worker/example-ci.build.build-linux64"
    )
    assert payloads["build-linux64/debug"]["supersederUrl"] == (
        f"{URL}/v1/docker-worker/example-ci.build.build-linux64.debug"
    )
    # generic-worker and the signing worker: no payload field they would not understand
    for label in ("test-unit", "test-lint", "signing-linux64"):
        assert "supersederUrl" not in payloads[label], label
    # what the task transforms made is otherwise untouched
    assert payloads["build-linux64"]["image"] == "debian:12"


def test_two_pushes_give_the_same_keys(project: Project) -> None:
    first, second = project.generate(push=1), project.generate(push=2)
    differ = [label for label in first if first[label]["task"] != second[label]["task"]]
    assert differ, "the two pushes' definitions should differ somewhere (their revision)"
    assert routes(first) == routes(second)
    assert sum(map(len, routes(first).values())) == 4


def test_thresholds_and_a_per_project_url(project: Project) -> None:
    project.configure(
        url={"by-project": {"try": None, "default": "https://c.example.com/"}}, age=600, size=2
    )
    graph = project.generate()
    assert graph["build-linux64"]["task"]["payload"]["supersederUrl"] == (
        "https://c.example.com/v1/docker-worker/600/2/example-ci.build.build-linux64"
    )
    on_try = project.generate(project="try")
    assert "supersederUrl" not in on_try["build-linux64"]["task"]["payload"]
    assert routes(on_try)["build-linux64"] == ["coalesce.v1.try.build.build-linux64"]


def test_opting_kinds_and_labels_in_and_out(project: Project) -> None:
    project.configure(
        **{"exclude-kinds": ["test"], "labels": ["signing-*"], "exclude-labels": ["*/debug"]}
    )
    assert routes(project.generate()) == {
        "build-linux64": ["coalesce.v1.example-ci.build.build-linux64"],
        "build-linux64/debug": [],
        "test-unit": [],
        "test-lint": [],
        "signing-linux64": ["coalesce.v1.example-ci.signing.signing-linux64"],
    }


def test_shipping_phase_tasks_are_left_out(project: Project) -> None:
    def ship(doc: dict[str, Any]) -> None:
        doc["tasks"]["linux64"]["shipping-phase"] = "build"

    project.edit(ship, "kinds/build/kind.yml")
    assert routes(project.generate())["build-linux64"] == []
    project.configure(**{"shipping-phase": True})
    assert routes(project.generate())["build-linux64"] != []


def test_the_template_shapes_the_key(project: Project) -> None:
    project.configure(key="{trust_domain}.{project}.{attributes[build_platform]}.{label}")
    graph = project.generate()
    assert routes(graph)["build-linux64/debug"] == [
        "coalesce.v1.example.example-ci.linux64.build-linux64.debug"
    ]


def test_the_rank_tag_holds_the_push_number_and_the_keys_stay(project: Project) -> None:
    project.configure(**{"rank-tag": "push"})
    first, second = project.generate(push=1), project.generate(push=7)
    assert first["test-unit"]["task"]["tags"]["push"] == "1"
    assert second["test-unit"]["task"]["tags"]["push"] == "7"
    assert "push" not in first["signing-linux64"]["task"]["tags"]  # left out: untouched
    assert routes(first) == routes(second)


def failure(project: Project) -> str:
    done = project.run("full", 1)
    assert done.returncode != 0, done.stdout[-2000:]
    return done.stderr.strip().splitlines()[-1]


def test_a_bad_template_fails_generation_with_one_line_naming_kind_and_label(
    project: Project,
) -> None:
    project.configure(key="{project}.{kind} {label}")
    line = failure(project)
    assert line.startswith("coalescer.taskgraph.TaskgraphError: coalescer: kind "), line
    # the kind and label of a task that would have been coalesced, and what is wrong
    assert any(f"kind {k}, task {k}-" in line for k in ("build", "test")), line
    assert "malformed coalescing key" in line


def test_two_tasks_of_a_push_under_one_key_fail_generation(project: Project) -> None:
    project.configure(key="{project}.{kind}")
    line = failure(project)
    assert line.startswith("coalescer.taskgraph.TaskgraphError: coalescer: kind "), line
    assert "has the key example-ci." in line and "would supersede each other" in line, line


@pytest.mark.parametrize(
    ("template", "says"),
    [
        ("{project}.{head_rev}.{label}", "names head_rev, which changes on every push"),
        ("{project}.{pushlog_id}", "names pushlog_id, which changes on every push"),
        ("{project}.{branch}", "names branch; it may name project, kind, label"),
        ("{project}.{attributes[nope]}", "cannot be filled"),
    ],
)
def test_a_template_with_a_per_push_or_unknown_part_fails(
    project: Project, template: str, says: str
) -> None:
    project.configure(key=template)
    line = failure(project)
    assert "coalescer: kind " in line and ", task " in line and says in line, line


def test_the_transform_before_the_task_transforms_is_refused(project: Project) -> None:
    def default_loader(doc: dict[str, Any]) -> None:
        del doc["loader"]  # taskgraph's default loader appends the task transforms
        doc["transforms"] = ["coalescer.taskgraph:transforms"]

    project.edit(default_loader, "kinds/test/kind.yml")
    line = failure(project)
    assert "must come after the task transforms" in line and "kind test, task " in line, line


def test_the_registration_hook_applies_it_to_every_kind(project: Project) -> None:
    def without_transform(doc: dict[str, Any]) -> None:
        doc["transforms"].remove("coalescer.taskgraph:transforms")

    def default_loader(doc: dict[str, Any]) -> None:
        del doc["loader"]  # taskgraph's default loader appends the run and task transforms
        doc["transforms"] = []

    for kind in ("test", "signing"):
        project.edit(without_transform, f"kinds/{kind}/kind.yml")
    project.edit(default_loader, "kinds/build/kind.yml")
    assert all(r == [] for r in routes(project.generate()).values())

    def hook(doc: dict[str, Any]) -> None:
        doc["taskgraph"]["register"] = "coalescer.taskgraph:register"

    project.edit(hook, "config.yml")
    graph = project.generate()
    assert routes(graph)["test-unit"] == ["coalesce.v1.example-ci.test.test-unit"]
    assert routes(graph)["signing-linux64"] == []
    assert "supersederUrl" in graph["build-linux64"]["task"]["payload"]


def test_without_a_coalescer_section_the_hook_says_what_to_add(project: Project) -> None:
    project.edit(lambda doc: doc.pop("coalescer"), "config.yml")
    line = failure(project)
    assert "has no 'coalescer:' section" in line and "kind " in line, line
