"""A history kept in one file: what a queue and a coalescer service answered when the replay
read task groups from them (``coalescer replay --task-group ... --save FILE``), read back
without either (``coalescer replay --recorded FILE``).

The file holds exactly what :func:`coalescer.replay.sources.from_task_groups` asked: each task
group's tasks (their definitions and statuses, as ``listTaskGroup`` gave them), the links of
the runs that may have been superseded (from each run's ``public/superseded-by.json``, or the
service's lineage) and the findings the service held for the history's keys. Read back, the
same answers give the same history, so a recording made on one queue replays anywhere, as the
tests' fixtures do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from coalescer.errors import InvalidInput
from coalescer.replay.links import Evidence
from coalescer.replay.runs import Identity, Link, Ref

#: The file's ``format``: a reader refuses another.
FORMAT = "coalescer-history/1"


@dataclasses.dataclass
class Answers:
    """What the queue and the service answered, in the file's shape."""

    groups: dict[str, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    links: dict[Ref, Link | None] = dataclasses.field(default_factory=dict)
    findings: dict[str, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    identities: frozenset[Identity] = frozenset()
    #: The coalescing route prefix the tasks were indexed under (none: the settings')
    prefix: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "routePrefix": self.prefix,
            "enforcerIdentities": sorted("/".join(i) for i in self.identities),
            "taskGroups": self.groups,
            "links": [
                {"taskId": t, "runId": r}
                | ({} if by is None else {"primary": by.primary, "cascade": by.cascade})
                for (t, r), by in sorted(self.links.items())
            ],
            "findings": self.findings,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Answers:
        if doc.get("format") != FORMAT:
            raise InvalidInput(f"not a recorded history (format {FORMAT!r} expected)")
        links: dict[Ref, Link | None] = {}
        for item in doc.get("links", ()):
            ref = (str(item["taskId"]), int(item["runId"]))
            has = "primary" in item
            links[ref] = Link(str(item["primary"]), bool(item["cascade"])) if has else None
        identities = frozenset(tuple(i.split("/", 1)) for i in doc.get("enforcerIdentities", ()))
        return cls(
            groups={str(g): list(tasks) for g, tasks in doc.get("taskGroups", {}).items()},
            links=links,
            findings={str(k): list(f) for k, f in doc.get("findings", {}).items()},
            identities=frozenset((str(g), str(w)) for g, w in identities),
            prefix=doc.get("routePrefix"),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_bytes(orjson.dumps(self.to_json()) + b"\n")

    @classmethod
    def load(cls, path: str | Path) -> Answers:
        try:
            doc = orjson.loads(Path(path).read_bytes())
        except orjson.JSONDecodeError as exc:
            raise InvalidInput(f"{path}: {exc}") from exc
        if not isinstance(doc, dict):
            raise InvalidInput(f"{path}: not a recorded history")
        try:
            return cls.from_json(doc)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InvalidInput(f"{path}: a recorded history with a bad entry ({exc!r})") from exc


#: What a recording leaves out of each task's definition: nothing the replay reads, and what
#: may be private (commands, their environment, scopes).
LEFT_OUT = frozenset({"payload", "metadata", "scopes", "extra"})


def kept(entry: Mapping[str, Any]) -> dict[str, Any]:
    """A ``listTaskGroup`` entry as a recording keeps it: its status, and its definition
    without :data:`LEFT_OUT`."""
    definition = {k: v for k, v in entry["task"].items() if k not in LEFT_OUT}
    return {"task": definition, "status": entry["status"]}


class RecordingQueue:
    """A queue client that keeps every task ``listTaskGroup`` gives, page by page."""

    def __init__(self, queue: Any, answers: Answers) -> None:
        self._queue, self._answers = queue, answers

    def listTaskGroup(self, group: str, query: Mapping[str, str] | None = None) -> Any:
        page = self._queue.listTaskGroup(group, query=dict(query or {}))
        self._answers.groups.setdefault(group, []).extend(map(kept, page["tasks"]))
        return page

    def buildUrl(self, *args: Any) -> Any:
        return self._queue.buildUrl(*args)


class RecordedQueue:
    """A queue client that answers ``listTaskGroup`` from a recording, in one page."""

    def __init__(self, answers: Answers) -> None:
        self._answers = answers

    def listTaskGroup(self, group: str, query: Mapping[str, str] | None = None) -> Any:
        if group not in self._answers.groups:
            raise InvalidInput(f"the recording holds no task group {group}")
        return {"taskGroupId": group, "tasks": self._answers.groups[group]}


@dataclasses.dataclass(frozen=True)
class RecordingEvidence(Evidence):
    """:class:`Evidence` that keeps every link and finding it read in ``answers``."""

    answers: Answers = dataclasses.field(default_factory=Answers)

    def links(self, refs: Sequence[Ref]) -> dict[Ref, Link]:
        found = super().links(refs)
        self.answers.links.update({ref: found.get(ref) for ref in refs})
        return found

    def findings(self, keys: Collection[str]) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        for key in sorted(keys):
            these = super().findings([key])
            self.answers.findings[key] = these
            found += these
        return found


@dataclasses.dataclass(frozen=True)
class RecordedEvidence(Evidence):
    """:class:`Evidence` that answers from a recording: the links and findings read when it
    was made (a run it holds no link for had none)."""

    answers: Answers = dataclasses.field(default_factory=Answers)

    def links(self, refs: Sequence[Ref]) -> dict[Ref, Link]:
        return {ref: by for ref in refs if (by := self.answers.links.get(ref)) is not None}

    def findings(self, keys: Collection[str]) -> list[dict[str, Any]]:
        return [f for key in sorted(keys) for f in self.answers.findings.get(key, ())]

    @property
    def reads_links(self) -> bool:
        return True


def recording(queue: Any, evidence: Evidence) -> tuple[RecordingQueue, RecordingEvidence]:
    """``queue`` and ``evidence`` that keep what they answer, in the evidence's ``answers``."""
    answers = Answers(identities=evidence.identities)
    kept = RecordingEvidence(
        evidence.identities, evidence.queue, evidence.service, evidence.timeout, answers
    )
    return RecordingQueue(queue, answers), kept


def replaying(answers: Answers) -> tuple[RecordedQueue, RecordedEvidence, list[str]]:
    """A queue and evidence answering from ``answers``, and its task groups."""
    identities = answers.identities or Evidence().identities
    return (
        RecordedQueue(answers),
        RecordedEvidence(identities, answers=answers),
        list(answers.groups),
    )
