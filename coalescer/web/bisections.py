"""Bisection findings over HTTP, and the bisection sections of the pages.

When the newest task of a key fails, the superseding side bisects the pushes it held to locate
the first failing one, the culprit (:mod:`coalescer.bisection`). The enforcer records its
findings itself; a worker reports its own here:

* ``GET /v1/bisections?key=`` — a key's findings, newest first, a page at a time
  (:func:`list_bisections`);
* ``GET /v1/bisections/gap?key=&before=[&after=]`` — what the index knows of the key's tasks
  ordered between two of them (:func:`gap`): a worker's search, which ran only what it held,
  asks it before it names a culprit;
* ``POST /v1/bisections`` — one finding (the shape in :mod:`coalescer.store.bisections`,
  without ``tasks``, which the store adds), authenticated as ``POST /v1/events`` is, checked
  strictly (:data:`FINDING`, every taskId and the key), recorded and counted
  (:func:`coalescer.observe.bisection_recorded`);
* :func:`for_task` — the findings that name a task, each with the task's role in it
  (:data:`ROLES`): the ``bisection`` field of ``GET /v1/tasks/<taskId>`` and the task page's
  section; :func:`recent` for the key page.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jsonschema
from starlette.requests import Request
from starlette.responses import Response

from coalescer import keyset, model
from coalescer.errors import InvalidInput
from coalescer.logs import Throttled
from coalescer.observe import FINDINGS_LIMITED, bisection_recorded
from coalescer.store import Store, bisections
from coalescer.store import keyset as stored
from coalescer.web.ingest import check_token, json_body
from coalescer.web.responses import JSON, error
from coalescer.web.shapes import INSTANT

#: Bounds on a reported finding: a search over at most :data:`MAX_HELD` held tasks makes a few
#: dozen runs at most (``coalescer.bisection.max_runs``).
MAX_RUNS = 64
MAX_REFS = 64
#: Tasks that did not run: all of those held but the few that ran (``--max-supersede``).
MAX_STANDS = 256
MAX_HELD = 1000
MAX_RUN_ID = 1000
MAX_ATTEMPT = 64
MAX_BY = 200
MAX_BODY_BYTES = 64 * 1024
#: One line when findings are refused at the limit, then one every 10 s with the count.
_LIMITED_LOG = Throttled(logging.getLogger(__name__))
#: A task's role in a finding, the most telling first: a task that is both the culprit and a
#: run of the search is the culprit.
ROLES = ("primary", "culprit", "lastGood", "ran", "stoodFor")


def _ref(description: str, *, nullable: bool = False) -> dict[str, Any]:
    return {
        "type": ["object", "null"] if nullable else "object",
        "description": description,
        "required": ["taskId", "runId"],
        "additionalProperties": False,
        "properties": {
            "taskId": {"type": "string", "pattern": model.TASK_ID_RE.pattern},
            "runId": {"type": "integer", "minimum": 0, "maximum": MAX_RUN_ID},
        },
    }


def _instant(description: str, *, nullable: bool = False) -> dict[str, Any]:
    kind = ["string", "null"] if nullable else "string"
    return {"type": kind, "pattern": INSTANT["pattern"], "description": description}


def _refs(description: str, item: dict[str, Any], most: int = MAX_REFS) -> dict[str, Any]:
    return {"type": "array", "maxItems": most, "items": item, "description": description}


_RUN = _ref("a run of the search")
_RUN["required"] = ["taskId", "runId", "attempt", "passed", "ended"]
_RUN["properties"] = {
    **_RUN["properties"],
    "attempt": {
        "type": "integer",
        "minimum": 0,
        "maximum": MAX_ATTEMPT,
        "description": "0: the run's first attempt; k: its k-th confirmation",
    },
    "passed": {"type": "boolean"},
    "ended": _instant("when the attempt ended", nullable=True),
}
_STAND = _ref("a task run that did not run, superseded by the run whose result stands for it")
_STAND["required"] = ["taskId", "runId", "by"]
_STAND["properties"] = {**_STAND["properties"], "by": _ref("the run that stands for it")}

#: A finding as a worker reports it (JSON Schema 2020-12, also the OpenAPI request body).
FINDING: dict[str, Any] = {
    "type": "object",
    "required": [
        "key",
        "by",
        "primary",
        "held",
        "culprit",
        "lastGood",
        "runs",
        "intermittent",
        "standsFor",
        "extraRuns",
        "located",
    ],
    "additionalProperties": False,
    "properties": {
        "key": {
            "type": "string",
            "pattern": model.KEY_RE.pattern,
            "maxLength": model.MAX_KEY_LENGTH,
            "description": "the coalescing key",
        },
        "by": {
            "type": "string",
            "minLength": 1,
            "maxLength": MAX_BY,
            "description": "who ran the search (``worker <group>/<id>``)",
        },
        "primary": _ref("the newest task, whose failure started the search"),
        "held": {
            "type": "integer",
            "minimum": 0,
            "maximum": MAX_HELD,
            "description": "older tasks the primary held",
        },
        "culprit": _ref(
            "the first failing task; null when the primary's failure did not come back",
            nullable=True,
        ),
        "lastGood": _ref("the newest task that passed, older than the culprit", nullable=True),
        "verdict": {
            "enum": ["culprit", "flaky", "inconclusive"],
            "description": "culprit: one named, sure enough; flaky: the primary's failure did "
            "not come back; inconclusive: the reruns were spent before the suspect's failure "
            "was sure enough (optional: older reports have none)",
        },
        "suspect": _ref(
            "with an inconclusive verdict, the first failing task, not sure enough to blame",
            nullable=True,
        ),
        "probability": {
            "type": ["number", "null"],
            "minimum": 0,
            "maximum": 1,
            "description": "the probability that the culprit (or suspect) is broken",
        },
        "rounds": {
            "type": "integer",
            "minimum": 0,
            "maximum": MAX_RUNS,
            "description": "waves of runs: runs made at once share one (optional)",
        },
        "flake": {
            "type": "number",
            "exclusiveMinimum": 0,
            "exclusiveMaximum": 1,
            "description": "the key's flake rate the search weighed failures with",
        },
        "runs": {
            "type": "array",
            "minItems": 1,
            "maxItems": MAX_RUNS,
            "items": _RUN,
            "description": "every run of the search in order, the primary's first included",
        },
        "intermittent": _refs("runs whose failure a confirmation did not reproduce", _ref("")),
        "standsFor": _refs(
            "the tasks that did not run, and what stands for each", _STAND, MAX_STANDS
        ),
        "extraRuns": {
            "type": "integer",
            "minimum": 0,
            "maximum": MAX_RUNS,
            "description": "runs beyond the primary's first",
        },
        "gap": {
            "type": "integer",
            "minimum": 0,
            "maximum": MAX_HELD,
            "description": "pushes of the gap the search ran again, beyond those the primary "
            "held: superseded or canceled earlier, or never scheduled (optional)",
        },
        "located": _instant("when the search ended"),
    },
}
_CHECK = jsonschema.Draft202012Validator(FINDING)
#: An instant exactly (the schema's pattern, with `$` read as ECMA 262 reads it).
_INSTANT = re.compile(INSTANT["pattern"].rstrip("$") + r"\Z")


def check(doc: Any) -> dict[str, Any]:
    """``doc`` if it is a finding :data:`FINDING` allows whose taskIds, key and times are
    well-formed; else :class:`InvalidInput` saying what is wrong, and where."""
    found = sorted(_CHECK.iter_errors(doc), key=lambda e: list(e.absolute_path))
    if found:
        raise InvalidInput(
            "not a bisection finding: "
            + "; ".join(
                f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in found[:5]
            )
        )
    # The schema's patterns read `$` as Python does (a final newline passes): check exactly.
    model.check_key(doc["key"])
    for where, ref in _refs_in(doc):
        try:
            model.check_task_id(ref["taskId"])
        except InvalidInput as exc:
            raise InvalidInput(f"{where}: {exc}") from None
    for where, at in [("located", doc["located"])] + [
        (f"runs/{i}/ended", r["ended"]) for i, r in enumerate(doc["runs"])
    ]:
        if at is not None and not _INSTANT.fullmatch(at):
            raise InvalidInput(f"{where}: not a date-time like 2030-01-01T00:00:00.000Z: {at!r}")
        if at is not None:
            try:
                model.parse_time_ms(at)
            except InvalidInput as exc:
                raise InvalidInput(f"{where}: {exc}") from None
    _consistent(doc)
    return dict(doc)


#: How far ahead of the service's clock a finding's times may be (clocks drift), and the
#: earliest they may be: a date far ahead would stay the newest of its key for good.
MAX_AHEAD_MS = 24 * 3600 * 1000
EARLIEST = "2000-01-01T00:00:00.000Z"


def _consistent(doc: Mapping[str, Any], now_ms: int | None = None) -> None:
    """:class:`InvalidInput` unless ``doc``'s parts agree: whole numbers that are integers in
    the JSON (``1``, not ``1.0``), the primary's run and the culprit's among the runs, the
    culprit a run that failed, and times neither before :data:`EARLIEST` nor more than
    :data:`MAX_AHEAD_MS` after ``now_ms`` (the service's clock)."""
    numbers = [("held", doc["held"]), ("extraRuns", doc["extraRuns"])]
    numbers += [(f"{where}/runId", ref["runId"]) for where, ref in _refs_in(doc)]
    numbers += [(f"runs/{i}/attempt", r["attempt"]) for i, r in enumerate(doc["runs"])]
    for where, value in numbers:
        if type(value) is not int:
            raise InvalidInput(f"{where}: must be an integer, not {value!r}")
    ran = {(r["taskId"], r["runId"]): r for r in doc["runs"]}
    primary = (doc["primary"]["taskId"], doc["primary"]["runId"])
    if primary not in ran:
        raise InvalidInput("primary: not among the runs (they include the primary's first)")
    culprit = doc["culprit"]
    if culprit is not None:
        runs = [
            r
            for r in doc["runs"]
            if (r["taskId"], r["runId"]) == (culprit["taskId"], culprit["runId"])
        ]
        if not runs:
            raise InvalidInput("culprit: not among the runs of the search")
        if all(r["passed"] for r in runs):
            raise InvalidInput("culprit: every run of it passed")
    now = int(time.time() * 1000) if now_ms is None else now_ms
    earliest = model.parse_time_ms(EARLIEST)
    for where, at in [("located", doc["located"])] + [
        (f"runs/{i}/ended", r["ended"]) for i, r in enumerate(doc["runs"])
    ]:
        if at is None:
            continue
        ms = model.parse_time_ms(at)
        if ms > now + MAX_AHEAD_MS:
            raise InvalidInput(f"{where}: {at} is more than a day ahead of the service's clock")
        if ms < earliest:
            raise InvalidInput(f"{where}: {at} is before {EARLIEST}")


def _refs_in(doc: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """Every ``{taskId, runId}`` of a finding, with where it is."""
    refs: list[tuple[str, Any]] = [(name, doc[name]) for name in ("primary", "culprit", "lastGood")]
    refs += [(f"runs/{i}", r) for i, r in enumerate(doc["runs"])]
    refs += [(f"intermittent/{i}", r) for i, r in enumerate(doc["intermittent"])]
    for i, stand in enumerate(doc["standsFor"]):
        refs += [(f"standsFor/{i}", stand), (f"standsFor/{i}/by", stand["by"])]
    return [(where, ref) for where, ref in refs if ref is not None]


async def post_bisection(request: Request) -> Response:
    """``POST /v1/bisections``: record a worker's finding; the answer is the finding as
    stored, and whether it is ``new`` (a retry of the same finding is recorded and counted
    once)."""
    check_token(request)
    doc = await json_body(request, min(MAX_BODY_BYTES, request.app.state.settings.max_body_bytes))
    if isinstance(doc, Response):
        return doc
    finding = check(doc)
    store: Store = request.app.state.store
    limit = request.app.state.settings.max_findings
    if not await bisections.room(store, finding, limit=limit, now_ms=int(time.time() * 1000)):
        FINDINGS_LIMITED.inc()
        _LIMITED_LOG.log(
            logging.WARNING,
            "bisection finding refused: COALESCER_MAX_FINDINGS=%d findings are kept (each "
            "for 30 days)",
            limit,
        )
        return JSON(
            {
                "error": f"not recorded: the service keeps COALESCER_MAX_FINDINGS={limit} "
                "bisection findings, each for 30 days, and holds that many",
                "new": False,
            },
            507,
        )
    new = await bisections.record(store, finding, model.parse_time_ms(finding["located"]))
    if new:
        bisection_recorded(finding, "http")
    return JSON({"finding": {**finding, "tasks": bisections.named_tasks(finding)}, "new": new})


#: Findings per page of ``GET /v1/bisections``: by default, and at most.
PAGE = 20
MAX_PAGE = 200
#: A page's ``continuationToken``: ``<located ms>.<primary taskId>`` of its last finding.
TOKEN_PATTERN = r"^[0-9]{1,15}\.[A-Za-z0-9_-]{22}$"
_TOKEN = re.compile(r"([0-9]{1,15})\.([A-Za-z0-9_-]{22})")


def _cursor(token: str | None) -> bisections.Cursor | None:
    """Where a page starts: None for the first (no token); an empty or malformed token is bad
    input, as the schema's pattern says."""
    if token is None:
        return None
    match = _TOKEN.fullmatch(token)
    if match is None:
        raise InvalidInput(
            "query parameter 'continuationToken' must be one a previous page answered"
        )
    return int(match[1]), match[2]


async def list_bisections(request: Request) -> Response:
    """``GET /v1/bisections?key=K[&limit=N][&continuationToken=T]``: the key's findings,
    newest first, a page at a time (no token needed: the key pages show them too)."""
    params = request.query_params
    key = model.check_key(params.get("key", ""))
    raw_limit = params.get("limit")
    if raw_limit is None:
        limit = PAGE
    elif raw_limit.isascii() and raw_limit.isdigit() and 1 <= int(raw_limit[:6]) <= MAX_PAGE:
        limit = int(raw_limit)
    else:
        raise InvalidInput(f"query parameter 'limit' must be a whole number from 1 to {MAX_PAGE}")
    after = _cursor(params.get("continuationToken"))
    found, more = await bisections.page(request.app.state.store, key, limit=limit, after=after)
    body: dict[str, Any] = {"key": key, "findings": found}
    if more is not None:
        body["continuationToken"] = f"{more[0]}.{more[1]}"
    return JSON(body)


async def gap(request: Request) -> Response:
    """``GET /v1/bisections/gap?key=K&before=C[&after=G]``: the tasks of ``K`` the index knows
    (pending, running or resolved, until their deadline passes) ordered strictly between task
    ``G`` and task ``C`` (below ``C`` when no ``after``), oldest first, each with its latest
    run's state, and since when the index knows every task (``knownSince``, the marker's
    time). 404 when the index does not know ``C`` or ``G`` under the key."""
    params = request.query_params
    key = model.check_key(params.get("key", ""))
    before = model.check_task_id(params.get("before", ""))
    after = params.get("after")
    if after is not None:
        after = model.check_task_id(after)
    known = await request.app.state.store.all_known(key)
    for task_id in (before, after):
        if task_id is not None and task_id not in known:
            return error(404, f"the index knows no task {task_id} of key {key}", taskId=task_id)
    top = known[before].order
    low = float("-inf") if after is None else known[after].order
    between = sorted(
        (r for r in known.values() if low < r.order < top), key=lambda r: (r.order, r.task_id)
    )
    tasks = [
        {"taskId": r.task_id, "runId": r.run_id, "order": r.order, "state": r.state}
        for r in between
    ]
    since = (await request.app.state.store.index_state(int(time.time() * 1000))).since_ms
    return JSON({"key": key, "tasks": tasks, "knownSince": model.format_time_ms(since)})


def role(finding: Mapping[str, Any], task_id: str) -> str | None:
    """``task_id``'s role in ``finding`` (:data:`ROLES`), or None when it names no such task."""

    def named(ref: Any) -> bool:
        return isinstance(ref, Mapping) and ref.get("taskId") == task_id

    if named(finding.get("primary")):
        return "primary"
    if named(finding.get("culprit")):
        return "culprit"
    if named(finding.get("lastGood")):
        return "lastGood"
    ran = [*(finding.get("runs") or []), *(finding.get("intermittent") or [])]
    if any(named(r) for r in ran):
        return "ran"
    if any(named(s) for s in finding.get("standsFor") or []):
        return "stoodFor"
    return None


async def for_task(
    store: Store, task_id: str, names: Sequence[str] | None = None
) -> list[dict[str, Any]]:
    """The findings that name ``task_id``, newest first, each as stored plus ``role``: under
    ``names``, or else under the :data:`~coalescer.keyset.TASK_PAGE_KEYS` most recently
    active keys (as the task's page looks for the task)."""
    if names is None:
        listed, _ = await stored.recent(store, 0, keyset.TASK_PAGE_KEYS - 1)
        names = [k for k, _ in listed]
    found = await bisections.for_task(store, names, task_id)
    out = [{**f, "role": r} for f in found if (r := role(f, task_id)) is not None]
    out.sort(key=lambda f: str(f.get("located", "")), reverse=True)
    return out


async def recent(store: Store, key: str) -> list[dict[str, Any]]:
    """The key's newest findings, newest first, for its page."""
    return await bisections.recent(store, key)
