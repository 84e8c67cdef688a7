"""coalescer.taskgraph's pure decisions: the configuration, who opts in, the key, the task."""

from __future__ import annotations

import ast
import subprocess
import sys
from typing import Any

import pytest

from coalescer.errors import ConfigError, InvalidInput
from coalescer.taskgraph import (
    Config,
    TaskgraphError,
    coalesce,
    implementation_of,
    opted_in,
    parse_config,
    render_key,
)


def test_defaults() -> None:
    config = parse_config({"url": "https://c.example.com/"})
    assert config.url_for("autoland") == "https://c.example.com"
    assert config.key == "{project}.{kind}.{label}"
    assert config.route_prefix == "coalesce.v1"


@pytest.mark.parametrize(
    ("doc", "says"),
    [
        ([], "must be a mapping"),
        ({"urls": "x"}, "unknown option(s) urls"),
        ({"url": "ftp://x"}, "not an http(s) URL"),
        ({"url": "https://x/?a=1"}, "without a query string"),
        ({"url": {"try": "https://x"}}, "by-project"),
        ({"key": "{project}.{head_rev}"}, "names head_rev, which changes on every push"),
        ({"key": "{project}.{0}"}, "names 0; it may name project, kind, label"),
        ({"key": "{project"}, "key template '{project'"),
        ({"key": 3}, "template string"),
        ({"age": -1}, "age must be a whole number"),
        ({"size": True}, "size must be a whole number"),
        ({"kinds": [3]}, "kinds must be a glob"),
        ({"shipping-phase": "yes"}, "shipping-phase must be true or false"),
        ({"route-prefix": "a b"}, "route-prefix 'a b'"),
        ({"route-prefix": "a..b"}, "route-prefix 'a..b' is not a dotted"),
        ({"rank-tag": "a tag"}, "rank-tag 'a tag' is not a tag or parameter name"),
        ({"rank-parameter": "pushdate"}, "rank-parameter only applies with rank-tag"),
    ],
)
def test_bad_configuration_is_one_line(doc: Any, says: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config(doc)
    message = str(raised.value)
    assert says in message and "\n" not in message
    assert message.startswith("taskcluster/config.yml: coalescer")


def test_per_project_url() -> None:
    config = parse_config(
        {"url": {"by-project": {"try": None, "release-*": None, "default": "https://c"}}}
    )
    assert config.url_for("try") is None
    assert config.url_for("release-esr") is None
    assert config.url_for("autoland") == "https://c"


def _in(config: Config, kind: str, label: str = "x", **attributes: Any) -> bool:
    return opted_in(config, project="p", kind=kind, label=label, attributes=attributes)


def test_release_signing_beetmover_and_shipping_phase_are_out_by_default() -> None:
    config = Config()
    assert _in(config, "build") and _in(config, "test")
    for kind in ("release-notify", "signing", "build-signing", "beetmover-repackage"):
        assert not _in(config, kind), kind
    assert not _in(config, "build", shipping_phase="promote")
    assert _in(config, "build", shipping_phase=None)


def test_labels_opt_in_exclusions_win() -> None:
    config = parse_config({"labels": ["signing-fast"], "exclude-labels": ["build-*/debug"]})
    assert _in(config, "signing", "signing-fast")
    assert not _in(config, "build", "build-linux/debug")
    assert not _in(config, "signing", "signing-fast", shipping_phase="ship")
    assert not opted_in(
        parse_config({"projects": ["autoland"]}),
        project="try",
        kind="build",
        label="b",
        attributes={},
    )


def test_keys_turn_slashes_into_words_and_are_checked() -> None:
    fields = {"project": "p", "kind": "test", "label": "test-linux/opt-1"}
    assert render_key("{project}.{kind}.{label}", fields) == "p.test.test-linux.opt-1"
    with pytest.raises(InvalidInput, match="malformed coalescing key"):
        render_key("{project} {kind}", fields)
    with pytest.raises(InvalidInput, match="cannot be filled"):
        render_key("{attributes[x]}", fields | {"attributes": {}})


def _task(implementation: str | None = None) -> dict[str, Any]:
    tags = {"worker-implementation": implementation} if implementation else {}
    return {"label": "build-linux", "attributes": {}, "task": {"payload": {}, "tags": tags}}


def _coalesce(task: dict[str, Any], config: Config, impl: str | None) -> dict[str, Any]:
    return coalesce(
        task, config, kind="build", project="p", level="3", trust_domain="t", implementation=impl
    )


def test_docker_worker_gets_the_url_others_the_route_only() -> None:
    config = parse_config({"url": "https://c", "age": 60})
    docker = _coalesce(_task(), config, "docker-worker")
    assert docker["task"]["routes"] == ["coalesce.v1.p.build.build-linux"]
    assert docker["task"]["payload"]["supersederUrl"] == (
        "https://c/v1/docker-worker/60/0/p.build.build-linux"
    )
    generic = _coalesce(_task(), config, "generic-worker")
    assert generic["task"]["routes"] == ["coalesce.v1.p.build.build-linux"]
    assert generic["task"]["payload"] == {}
    # twice (a kind that lists it and the hook) changes nothing more
    again = _coalesce(docker, config, "docker-worker")
    assert again["task"]["routes"] == ["coalesce.v1.p.build.build-linux"]


def test_a_key_two_tasks_of_one_graph_share_is_refused() -> None:
    config = parse_config({"key": "{project}.{kind}"})
    taken: dict[str, str] = {}
    first = _task()
    coalesce(
        first,
        config,
        kind="build",
        project="p",
        level="3",
        trust_domain="t",
        implementation=None,
        taken=taken,
    )
    coalesce(  # the same task again (listed and registered) is no conflict
        first,
        config,
        kind="build",
        project="p",
        level="3",
        trust_domain="t",
        implementation=None,
        taken=taken,
    )
    second = _task() | {"label": "build-mac"}
    with pytest.raises(TaskgraphError) as raised:
        coalesce(
            second,
            config,
            kind="build",
            project="p",
            level="3",
            trust_domain="t",
            implementation=None,
            taken=taken,
        )
    assert str(raised.value) == (
        "coalescer: kind build, task build-mac: task build-linux has the key p.build too, and "
        "tasks of one push under one key would supersede each other: make the key template "
        "tell them apart (with {label})"
    )


def test_a_bad_key_names_kind_and_label() -> None:
    config = parse_config({"key": "{project}.{kind}.{label}!"})
    with pytest.raises(TaskgraphError) as raised:
        _coalesce(_task(), config, None)
    assert str(raised.value).startswith("coalescer: kind build, task build-linux: malformed")


def test_the_rank_tag_carries_the_push_number() -> None:
    config = parse_config({"rank-tag": "push"})
    task = coalesce(
        _task(),
        config,
        kind="build",
        project="p",
        level="3",
        trust_domain="t",
        implementation=None,
        rank="1234",
    )
    assert task["task"]["tags"]["push"] == "1234"
    for rank in ("", None, "nan", "abc"):
        with pytest.raises(TaskgraphError) as raised:
            coalesce(
                _task(),
                config,
                kind="build",
                project="p",
                level="3",
                trust_domain="t",
                implementation=None,
                rank=rank,
            )
        assert str(raised.value).startswith(
            "coalescer: kind build, task build-linux: rank-tag push takes the parameter "
            "pushlog_id, which is"
        )


def test_implementation_from_the_tag_or_the_alias() -> None:
    aliases = {
        "b-linux": {
            "provisioner": {"by-level": {"3": "{trust-domain}-3", "default": "{trust-domain}-1"}},
            "implementation": "docker-worker",
            "worker-type": "b-linux",
        }
    }
    tagged = {"task": {"tags": {"worker-implementation": "generic-worker"}}}
    assert implementation_of(tagged, aliases, level="3", trust_domain="t") == "generic-worker"
    named = {"task": {"provisionerId": "t-3", "workerType": "b-linux"}}
    assert implementation_of(named, aliases, level="3", trust_domain="t") == "docker-worker"
    assert implementation_of(named, aliases, level="1", trust_domain="t") is None
    queue = {"task": {"taskQueueId": "t-1/b-linux"}}
    assert implementation_of(queue, aliases, level="1", trust_domain="t") == "docker-worker"


def test_the_transform_needs_nothing_but_coalescer_and_the_standard_library() -> None:
    # docs/how-to/taskgraph.md: `pip install --no-deps coalescer` is enough in a decision image
    code = (
        "import sys, coalescer.taskgraph; "
        "print(sorted({m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(ast.literal_eval(done.stdout)) - {"coalescer", "__main__"}
    assert not {m for m in loaded if not m.startswith("_")}, loaded
