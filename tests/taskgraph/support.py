"""Real taskgraph on the example project in ``project/``: copy it, adjust its configuration,
generate a graph with taskgraph's own command line in a child process (taskgraph registers one
project per process), read the JSON it prints."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

import coalescer

PROJECT = Path(__file__).parent / "project"
#: Where ``coalescer`` is imported from: the child process imports the same one.
SOURCE = Path(coalescer.__file__).resolve().parent.parent


class Project:
    """A copy of the example project in ``root``, outside any repository."""

    def __init__(self, root: Path) -> None:
        shutil.copytree(PROJECT, root)
        self.root = root
        self.config_yml = root / "taskcluster" / "config.yml"

    def configure(self, **coalescer: Any) -> None:
        """Replace options of ``config.yml``'s ``coalescer:`` section (``None`` removes one)."""
        self.edit(lambda doc: doc["coalescer"].update(coalescer))

    def edit(self, change: Any, path: str = "config.yml") -> None:
        """Apply ``change(doc)`` to a YAML file under ``taskcluster/``."""
        file = self.root / "taskcluster" / path
        doc = yaml.safe_load(file.read_text())
        change(doc)
        file.write_text(yaml.safe_dump(doc, sort_keys=False))

    def generate(self, push: int = 1, *, graph: str = "full", **params: Any) -> dict[str, Any]:
        """The ``taskgraph <graph> --json`` output for push number ``push``."""
        done = self.run(graph, push, **params)
        assert done.returncode == 0, done.stderr[-4000:]
        return dict(json.loads(done.stdout))

    def run(self, graph: str, push: int, **params: Any) -> subprocess.CompletedProcess[str]:
        spec = self.root / f"parameters-{push}.yml"
        spec.write_text(yaml.safe_dump(parameters(push) | params))
        command = [
            sys.executable,
            "-c",
            "import sys; from taskgraph.main import main; sys.exit(main())",
            graph,
            "--json",
            "--root",
            "taskcluster",
            "-p",
            str(spec),
        ]
        env = dict(os.environ, PYTHONPATH=str(SOURCE))
        env.pop("TASKCLUSTER_ROOT_URL", None)
        return subprocess.run(
            command, cwd=self.root, env=env, capture_output=True, text=True, timeout=120
        )


def parameters(push: int) -> dict[str, Any]:
    """A decision task's parameters for push ``push``: every per-push part differs."""
    return {
        "project": "example-ci",
        "level": "3",
        "head_repository": "https://github.com/example/example",
        "base_repository": "https://github.com/example/example",
        "repository_type": "git",
        "head_rev": f"{push:040x}",
        "base_rev": f"{push - 1:040x}",
        "head_ref": f"refs/heads/push-{push}",
        "pushlog_id": str(push),
        "pushdate": 1_900_000_000 + push * 60,
        "build_date": 1_900_000_000 + push * 60,
        "moz_build_date": f"2030010100{push:04d}",
        "build_number": push,
        "owner": "dev@example.com",
    }


def routes(graph: dict[str, Any], prefix: str = "coalesce.v1.") -> dict[str, list[str]]:
    """Each task's coalescing routes, by label."""
    return {
        label: [r for r in task["task"].get("routes", []) if r.startswith(prefix)]
        for label, task in graph.items()
    }


def submit(
    queue: Any, graph: dict[str, Any], *, decision: str, scheduler: str, now: datetime
) -> dict[str, str]:
    """Create the tasks of a ``taskgraph morphed --json`` graph as a decision task does: in the
    decision task's group, each depending on the decision task unless it depends on a task of
    the graph, timestamps resolved, dependencies created first. Returns taskId -> label."""
    from taskgraph.util.parameterization import resolve_timestamps

    naive = now.astimezone(UTC).replace(tzinfo=None)  # as taskgraph's own clock gives it
    created: dict[str, str] = {}
    waiting = dict(graph)
    while waiting:
        ready = [
            task_id
            for task_id, entry in waiting.items()
            if all(d in created or d not in graph for d in entry["task"].get("dependencies", []))
        ]
        assert ready, f"a dependency loop among {sorted(waiting)}"
        for task_id in ready:
            entry = waiting.pop(task_id)
            definition = dict(entry["task"])
            dependencies = list(definition.get("dependencies", []))
            if not any(d in graph for d in dependencies):
                dependencies.append(decision)
            definition.update(
                dependencies=dependencies, taskGroupId=decision, schedulerId=scheduler
            )
            queue.createTask(task_id, resolve_timestamps(naive, definition))
            created[task_id] = entry["label"]
    return created
