"""Taskgraph transforms that give a project's tasks their coalescing route and superseder URL.

A Taskcluster project's decision task runs taskgraph (``taskcluster-taskgraph``, the
``coalescer[taskgraph]`` extra). Either list the transform in a kind, after the task
transforms (the ``taskgraph.loader.transform:loader`` loader)::

    transforms:
      - taskgraph.transforms.run:transforms
      - taskgraph.transforms.task:transforms
      - coalescer.taskgraph:transforms

or apply it to every kind from the project's registration hook (``taskgraph: register:`` in
``taskcluster/config.yml``), with :func:`register`. It is configured under one key of that
``config.yml``, ``coalescer:`` (``docs/how-to/taskgraph.md``)::

    coalescer:
      url: https://coalescer.example.com       # or {by-project: {try: ..., default: ...}}
      key: "{project}.{kind}.{label}"          # no per-push part: that never coalesces
      age: 600                                  # docker-worker's thresholds (optional)
      size: 2
      rank-tag: push                            # tag push = pushlog_id (COALESCER_RANK_TAG)

Every opted-in task gets the route ``coalesce.v1.<key>``; a docker-worker task also gets
``payload.supersederUrl`` (the service's docker-worker route); any other worker implementation
gets the route only (``coalescer enforce`` with a policy supersedes those). Release, signing and
beetmover kinds and every task with a ``shipping_phase`` are left out unless configured in.

The decisions are plain functions on plain data (:func:`parse_config`, :func:`opted_in`,
:func:`render_key`, :func:`coalesce`); :func:`transforms` is the thin taskgraph edge. Nothing
here imports taskgraph but :func:`register`, which needs it installed.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import re
import string
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from coalescer.errors import ConfigError, InvalidInput
from coalescer.model import KEY_RE, check_key

#: The key of ``taskcluster/config.yml`` this module reads.
CONFIG_KEY = "coalescer"
_NAME_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
DEFAULT_TEMPLATE = "{project}.{kind}.{label}"
DEFAULT_EXCLUDE_KINDS = ("*release*", "*signing*", "*beetmover*")
#: What a key template may name. Values have ``/`` turned into ``.`` (a label such as
#: ``build-linux64/opt`` gives the words ``build-linux64.opt``, as a URL path would).
FIELDS = ("project", "kind", "label", "level", "trust_domain", "attributes")
#: Parameters that change on every push: a key naming one never holds two pushes' tasks.
PER_PUSH = (
    "head_rev",
    "base_rev",
    "revision",
    "pushlog_id",
    "pushdate",
    "build_date",
    "moz_build_date",
    "build_number",
    "head_ref",
)
_OPTIONS = {
    "url",
    "key",
    "route-prefix",
    "age",
    "size",
    "projects",
    "kinds",
    "exclude-kinds",
    "labels",
    "exclude-labels",
    "shipping-phase",
    "rank-tag",
    "rank-parameter",
}


@dataclasses.dataclass(frozen=True)
class Config:
    """The ``coalescer:`` section of ``taskcluster/config.yml``, validated."""

    #: The service's base URL; per project when a mapping ``{project glob: url or None}``.
    url: str | Mapping[str, str | None] | None = None
    key: str = DEFAULT_TEMPLATE
    route_prefix: str = "coalesce.v1"
    age: int | None = None
    size: int | None = None
    projects: tuple[str, ...] = ("*",)
    kinds: tuple[str, ...] = ("*",)
    exclude_kinds: tuple[str, ...] = DEFAULT_EXCLUDE_KINDS
    labels: tuple[str, ...] = ()
    exclude_labels: tuple[str, ...] = ()
    shipping_phase: bool = False
    #: A task tag to carry the push's number (the service's ``COALESCER_RANK_TAG``), and the
    #: parameter it comes from: a key's tasks then keep push order however they are scheduled.
    rank_tag: str | None = None
    rank_parameter: str = "pushlog_id"

    def url_for(self, project: str) -> str | None:
        """The service URL for ``project`` (``None``: routes only)."""
        if self.url is None or isinstance(self.url, str):
            return self.url
        for pattern, url in self.url.items():
            if pattern != "default" and fnmatch.fnmatchcase(project, pattern):
                return url
        return self.url.get("default")


def parse_config(doc: Any, source: str = "taskcluster/config.yml") -> Config:
    """A :class:`Config` from the parsed ``coalescer:`` section, or ConfigError in one line."""
    where = f"{source}: {CONFIG_KEY}"
    if doc is None:
        doc = {}
    if not isinstance(doc, Mapping):
        raise ConfigError(f"{where}: must be a mapping (url, key, kinds, ...)")
    unknown = sorted(set(map(str, doc)) - _OPTIONS)
    if unknown:
        raise ConfigError(
            f"{where}: unknown option(s) {', '.join(unknown)} (known: {', '.join(sorted(_OPTIONS))})"
        )
    prefix = doc.get("route-prefix", Config.route_prefix)
    if not isinstance(prefix, str) or not KEY_RE.fullmatch(prefix):
        raise ConfigError(f"{where}: route-prefix {prefix!r} is not a dotted route prefix")
    key = doc.get("key", DEFAULT_TEMPLATE)
    if not isinstance(key, str):
        raise ConfigError(f"{where}: key must be a template string such as {DEFAULT_TEMPLATE!r}")
    _check_template(key, where)
    phase = doc.get("shipping-phase", False)
    if not isinstance(phase, bool):
        raise ConfigError(f"{where}: shipping-phase must be true or false")
    rank_tag, rank_parameter = doc.get("rank-tag"), doc.get("rank-parameter", "pushlog_id")
    for name, value in (("rank-tag", rank_tag), ("rank-parameter", rank_parameter)):
        if value is not None and (not isinstance(value, str) or not _NAME_RE.fullmatch(value)):
            raise ConfigError(f"{where}: {name} {value!r} is not a tag or parameter name")
    if "rank-parameter" in doc and rank_tag is None:
        raise ConfigError(f"{where}: rank-parameter only applies with rank-tag")
    return Config(
        url=_url(doc.get("url"), where),
        key=key,
        route_prefix=prefix,
        age=_whole(doc, "age", where),
        size=_whole(doc, "size", where),
        projects=_globs(doc, "projects", ("*",), where),
        kinds=_globs(doc, "kinds", ("*",), where),
        exclude_kinds=_globs(doc, "exclude-kinds", DEFAULT_EXCLUDE_KINDS, where),
        labels=_globs(doc, "labels", (), where),
        exclude_labels=_globs(doc, "exclude-labels", (), where),
        shipping_phase=phase,
        rank_tag=rank_tag,
        rank_parameter=rank_parameter,
    )


def _url(raw: Any, where: str) -> str | Mapping[str, str | None] | None:
    if raw is None:
        return None
    if isinstance(raw, str):
        return _http_url(raw, where)
    if isinstance(raw, Mapping) and list(raw) == ["by-project"]:
        per = raw["by-project"]
        if isinstance(per, Mapping) and per:
            return {
                str(p): None if u is None else _http_url(u, f"{where}: url for {p}")
                for p, u in per.items()
            }
    raise ConfigError(f"{where}: url must be a URL or {{by-project: {{<project>: <url>}}}}")


def _http_url(raw: Any, where: str) -> str:
    if not isinstance(raw, str) or not raw.startswith(("https://", "http://")) or "?" in raw:
        raise ConfigError(f"{where}: {raw!r} is not an http(s) URL without a query string")
    return raw.rstrip("/")


def _whole(doc: Mapping[str, Any], name: str, where: str) -> int | None:
    value = doc.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ConfigError(f"{where}: {name} must be a whole number >= 0, not {value!r}")
    return value


def _globs(
    doc: Mapping[str, Any], name: str, default: tuple[str, ...], where: str
) -> tuple[str, ...]:
    raw = doc.get(name)
    if raw is None:
        return default
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not all(isinstance(i, str) and i for i in items):
        raise ConfigError(f"{where}: {name} must be a glob or a list of globs")
    return tuple(items)


def _check_template(template: str, where: str) -> None:
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ConfigError(f"{where}: key template {template!r}: {exc}") from None
    for _, field, _, _ in parsed:
        if field is None:
            continue
        name = field.split("[", 1)[0].split(".", 1)[0]
        if name in PER_PUSH:
            raise ConfigError(
                f"{where}: key template {template!r} names {name}, which changes on every "
                "push: a key with a per-push part never holds two pushes' tasks"
            )
        if name not in FIELDS:
            raise ConfigError(
                f"{where}: key template {template!r} names {name or 'a field without a name'}; "
                f"it may name {', '.join(FIELDS)}"
            )


def opted_in(config: Config, *, project: str, kind: str, label: str, attributes: Any) -> bool:
    """Whether a task gets a coalescing key. Excluded labels and (unless configured in)
    shipping-phase tasks are out whatever else says; an opted-in label is in whatever its kind;
    otherwise its kind decides."""
    if not _any(config.projects, project) or _any(config.exclude_labels, label):
        return False
    if (
        isinstance(attributes, Mapping)
        and attributes.get("shipping_phase")
        and not (config.shipping_phase)
    ):
        return False
    if _any(config.labels, label):
        return True
    return _any(config.kinds, kind) and not _any(config.exclude_kinds, kind)


def _any(patterns: Iterable[str], name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def render_key(template: str, fields: Mapping[str, Any]) -> str:
    """The key ``template`` gives for one task, checked by the service's own key rules
    (:func:`coalescer.model.check_key`); InvalidInput when it is not a valid key."""
    values = {
        name: (
            {k: _word(v) for k, v in value.items()} if isinstance(value, Mapping) else _word(value)
        )
        for name, value in fields.items()
    }
    try:
        key = template.format_map(values)
    except (KeyError, IndexError, AttributeError, ValueError) as exc:
        raise InvalidInput(f"key template {template!r} cannot be filled: {exc!r}") from None
    return check_key(key)


def _word(value: Any) -> str:
    return str(value).replace("/", ".")


class TaskgraphError(ConfigError):
    """A task whose coalescing key cannot be made. Its message is one line naming the kind and
    the label, so that the decision task's log says what to fix."""


def coalesce(
    task: dict[str, Any],
    config: Config,
    *,
    kind: str,
    project: str,
    level: str,
    trust_domain: str,
    implementation: str | None,
    rank: Any = None,
    taken: dict[str, str] | None = None,
) -> dict[str, Any]:
    """``task`` (taskgraph's shape after the task transforms: ``label``, ``attributes``,
    ``task`` the definition) with its route, on docker-worker its ``supersederUrl``, and with
    ``rank-tag`` the tag holding ``rank`` (the push's number). Idempotent; a task left out is
    returned unchanged. ``taken`` (key -> label, filled in) refuses a key another task of the
    same graph already has: tasks of one push under one key would supersede each other."""
    label = str(task.get("label", ""))
    attributes = task.get("attributes") or {}
    definition = task.get("task")
    if not isinstance(definition, dict) or "payload" not in definition:
        raise TaskgraphError(
            f"coalescer: kind {kind}, task {label or '?'}: coalescer.taskgraph:transforms must "
            "come after the task transforms (taskgraph.transforms.task:transforms)"
        )
    if not opted_in(config, project=project, kind=kind, label=label, attributes=attributes):
        return task
    fields = {
        "project": project,
        "kind": kind,
        "label": label,
        "level": level,
        "trust_domain": trust_domain,
        "attributes": attributes,
    }
    try:
        key = render_key(config.key, fields)
    except InvalidInput as exc:
        raise TaskgraphError(f"coalescer: kind {kind}, task {label}: {exc}") from None
    if taken is not None:
        other = taken.setdefault(key, label)
        if other != label:
            raise TaskgraphError(
                f"coalescer: kind {kind}, task {label}: task {other} has the key {key} too, and "
                "tasks of one push under one key would supersede each other: make the key "
                "template tell them apart (with {label})"
            )
    route = f"{config.route_prefix}.{key}"
    routes = definition.setdefault("routes", [])
    if route not in routes:
        routes.append(route)
    if config.rank_tag is not None:
        if not _is_number(rank):
            raise TaskgraphError(
                f"coalescer: kind {kind}, task {label}: rank-tag {config.rank_tag} takes the "
                f"parameter {config.rank_parameter}, which is {rank!r}, not a number"
            )
        definition.setdefault("tags", {})[config.rank_tag] = str(rank)
    url = config.url_for(project)
    payload = definition.get("payload")
    if implementation == "docker-worker" and url is not None and isinstance(payload, dict):
        payload["supersederUrl"] = docker_worker_url(url, key, age=config.age, size=config.size)
    return task


def _is_number(value: Any) -> bool:
    if isinstance(value, bool) or value is None:
        return False
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def docker_worker_url(base: str, key: str, *, age: int | None, size: int | None) -> str:
    """The service's route for an unmodified docker-worker (it appends ``?taskId=``)."""
    if age is None and size is None:
        return f"{base}/v1/docker-worker/{key}"
    return f"{base}/v1/docker-worker/{age or 0}/{size or 0}/{key}"


def implementation_of(
    task: Mapping[str, Any], aliases: Mapping[str, Any], *, level: str, trust_domain: str
) -> str | None:
    """A generated task's worker implementation: the tag taskgraph sets when it takes it from
    a worker alias, else the alias whose provisioner and worker type the task names."""
    definition = task.get("task") or {}
    tag = (definition.get("tags") or {}).get("worker-implementation")
    if isinstance(tag, str):
        return tag
    queue = definition.get("taskQueueId") or "/".join(
        (str(definition.get("provisionerId")), str(definition.get("workerType")))
    )
    for alias, spec in aliases.items():
        if not isinstance(spec, Mapping):
            continue
        subs = {"alias": alias, "level": level, "trust-domain": trust_domain}
        named = [_by_level(spec.get(f), level) for f in ("provisioner", "worker-type")]
        try:
            if "/".join(str(n).format(**subs) for n in named) == queue:
                return str(spec.get("implementation"))
        except (KeyError, IndexError, ValueError):
            continue
    return None


def _by_level(value: Any, level: str) -> Any:
    if isinstance(value, Mapping) and list(value) == ["by-level"]:
        per = value["by-level"]
        return per.get(level, per.get(int(level) if level.isdigit() else level, per.get("default")))
    return value


# -- the taskgraph edge --------------------------------------------------------------------------
def config_of(graph_config: Any) -> Config:
    """The project's :class:`Config` from taskgraph's ``GraphConfig`` (``config.yml``)."""
    if CONFIG_KEY not in graph_config:
        raise TaskgraphError(
            f"taskcluster/config.yml has no '{CONFIG_KEY}:' section; add one "
            "(at least `coalescer: {url: https://<the service>}`), see docs/how-to/taskgraph.md"
        )
    return parse_config(graph_config[CONFIG_KEY])


def transforms(config: Any, tasks: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The transform: list it in a kind after the task transforms, or see :func:`register`."""
    settings: Config | None = None
    problem = ""
    try:
        settings = config_of(config.graph_config)
    except ConfigError as exc:
        problem = str(exc)
    params = config.params
    level = str(params["level"])
    trust_domain = str(config.graph_config["trust-domain"])
    aliases = (config.graph_config.get("workers") or {}).get("aliases") or {}
    taken: dict[str, str] = {}  # this kind's keys: other kinds load in other processes
    for task in tasks:
        if settings is None:  # said at the first task, naming it as every other failure does
            label = task.get("label", "?")
            raise TaskgraphError(f"coalescer: kind {config.kind}, task {label}: {problem}")
        implementation = implementation_of(task, aliases, level=level, trust_domain=trust_domain)
        yield coalesce(
            task,
            settings,
            kind=config.kind,
            project=str(params["project"]),
            level=level,
            trust_domain=trust_domain,
            implementation=implementation,
            rank=params.get(settings.rank_parameter) if settings.rank_tag else None,
            taken=taken,
        )


def register(graph_config: Any) -> None:
    """Apply :func:`transforms` to every kind: appended to taskgraph's task transforms.

    Use as the project's hook (``taskgraph: {register: coalescer.taskgraph:register}``) or
    call it from the project's own ``register(graph_config)``. The configuration is checked
    here, once, before any kind loads."""
    from taskgraph.transforms import task as task_transforms  # the extra: coalescer[taskgraph]

    config_of(graph_config)
    sequence = task_transforms.transforms
    if id(sequence) not in _REGISTERED:  # register() may be called more than once
        _REGISTERED.add(id(sequence))
        sequence.add(transforms)


_REGISTERED: set[int] = set()


__all__ = [
    "Config",
    "TaskgraphError",
    "coalesce",
    "opted_in",
    "parse_config",
    "register",
    "render_key",
    "transforms",
]
