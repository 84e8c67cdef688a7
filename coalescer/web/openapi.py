"""``GET /openapi.json``: the OpenAPI 3.1 description of every route, written by hand.

It is tested two ways: every route of the app has an operation here (and the other way
round), and a schema-driven fuzz test (schemathesis) checks that the answers match it.
"""

from __future__ import annotations

import copy
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from coalescer import __version__, model
from coalescer.web import bisections, shapes
from coalescer.web.responses import JSON

_SLUGID = model.TASK_ID_RE.pattern
#: A coalescing key in a path: the model's key, minus the reserved first segments.
_KEY = r"^(?!(?:v1|metrics|static|favicon\.ico|openapi\.json)$|__)" + model.KEY_RE.pattern[1:]

_PAGES = (
    "A browser (``Accept: text/html``) gets an HTML page; ``?format=json`` or any other "
    "``Accept`` gets JSON."
)


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str, *, html: bool = False) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": schema}}
    if html:
        content["text/html"] = {"schema": {"type": "string"}}
    return {"description": description, "content": content}


def _errors(*codes: int) -> dict[str, Any]:
    """Error responses: JSON, or a page for a browser (``Accept: text/html``)."""
    why = {
        400: "Malformed input; the body says what and why",
        401: "Missing or wrong bearer token",
        403: "Ingest is disabled (no COALESCER_INGEST_TOKEN)",
        404: "No such key, task or endpoint (reserved paths are not keys)",
        413: "Request body too large",
        503: "The store (Redis) is unavailable; retry shortly",
    }
    return {str(code): _json(_ref("Error"), why[code], html=True) for code in codes}


def _param(name: str, where: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": where,
        "required": where == "path",
        "schema": schema,
        "description": description,
    }


_KEY_PARAM = _param(
    "key",
    "path",
    {"type": "string", "pattern": _KEY, "maxLength": model.MAX_KEY_LENGTH},
    "Coalescing key (the part of the route after the prefix). In the native route a "
    "``/`` reads as ``.``: ``/build/linux`` is key ``build.linux``.",
)
_COMPAT_KEY_PARAM = _param(
    "key",
    "path",
    {"type": "string", "pattern": model.KEY_RE.pattern, "maxLength": model.MAX_KEY_LENGTH},
    "Coalescing key (dotted; no path is reserved here)",
)
#: The coalescing key a ``/v1/bisections`` route reads, as a query parameter.
_KEY_QUERY = {
    **_param(
        "key",
        "query",
        {"type": "string", "pattern": model.KEY_RE.pattern, "maxLength": model.MAX_KEY_LENGTH},
        "Coalescing key (dotted)",
    ),
    "required": True,
}
_TASK_PARAM = _param("taskId", "path", {"type": "string", "pattern": _SLUGID}, "a slugid")
_DOCKER_WORKER = (
    "For an unmodified docker-worker as ``supersederUrl``: the tasks it should supersede, "
    "**newest first** (it runs the first it claims), the initial task included while pending "
    "or running; only the initial task when the index does not know it or holds it resolved"
)
_DOCKER_WORKER_TASK = {
    **_param("taskId", "query", {"type": "string", "pattern": _SLUGID}, "the claimed task"),
    "required": True,
}
_COUNT = {"type": "integer", "minimum": 0, "maximum": 999_999_999_999}
_WHOLE = {"type": "integer", "minimum": 0}
#: An empty value (``?age=``) counts as absent.
_OPTIONAL_COUNT = {"anyOf": [_COUNT, {"const": ""}]}
_HEAD_CODES = ((200, "OK"), (400, "Malformed key"), (404, "Reserved path"), (503, "No store"))


def _op(summary: str, responses: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"summary": summary, "responses": responses, **extra}


def document() -> dict[str, Any]:
    """The OpenAPI document (a fresh dict: callers may change it)."""
    any_json = _json({"type": "object"}, "OK")
    counts = {
        "type": "object",
        "additionalProperties": {"type": "array", "items": {"type": "string"}},
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "coalescer",
            "version": __version__,
            "description": "A superseder service for Taskcluster-style task queues. "
            "Every error is a JSON body ``{error, status}`` (or, for a browser, a page).",
        },
        "paths": {
            "/": {
                "get": _op(
                    "Coalescing keys, most recently active first, 100 a page: pending count, "
                    "oldest wait, last activity. " + _PAGES,
                    {
                        "200": _json(_ref("Overview"), "The keys", html=True),
                        **_errors(400, 503),
                    },
                    parameters=[
                        _param(
                            "q",
                            "query",
                            {"type": "string"},
                            "filter: part of a key, or a glob (``*``, ``?``); each page "
                            "examines about 5,000 keys",
                        ),
                        _param(
                            "page",
                            "query",
                            {
                                "anyOf": [
                                    {"type": "integer", "minimum": 1, "maximum": 999_999_999},
                                    {"const": ""},
                                ]
                            },
                            "page number, from 1 (without ``q``)",
                        ),
                        _param(
                            "after",
                            "query",
                            {
                                "anyOf": [
                                    {"type": "integer", "minimum": 0, "maximum": 10**19 - 1},
                                    {"const": ""},
                                ]
                            },
                            "with ``q``: where the previous page's search stopped (its ``next``)",
                        ),
                    ],
                )
            },
            "/{key}": {
                "get": _op(
                    "With ``taskId``: the tasks the worker holding it should supersede, oldest "
                    "first, the initial task included; only the initial task when the index "
                    "does not know it and cannot learn it from the queue. Without: the key's "
                    "pending tasks. " + _PAGES,
                    {
                        "200": _json(
                            {"anyOf": [_ref("Supersedes"), _ref("KeyListing")]},
                            "The answer, or the key's pending tasks",
                            html=True,
                        ),
                        **_errors(400, 404, 503),
                    },
                    parameters=[
                        _KEY_PARAM,
                        _param(
                            "taskId",
                            "query",
                            {"type": "string", "pattern": _SLUGID},
                            "the task the worker claimed",
                        ),
                        _param(
                            "age", "query", _OPTIONAL_COUNT, "supersede only past this wait (s)"
                        ),
                        _param(
                            "size",
                            "query",
                            _OPTIONAL_COUNT,
                            "supersede only above this many pending",
                        ),
                    ],
                ),
                "head": _op(
                    "As GET, without a body",
                    {str(c): {"description": d} for c, d in _HEAD_CODES},
                    parameters=[_KEY_PARAM],
                ),
            },
            "/tasks/{taskId}": {
                "get": _op(
                    "What the service knows of a task: its keys, versions, and what it "
                    "superseded or was superseded by. " + _PAGES,
                    {
                        "200": _json(_ref("Task"), "The task", html=True),
                        **_errors(400, 404, 503),
                    },
                    parameters=[
                        _TASK_PARAM,
                        _param(
                            "key",
                            "query",
                            {"type": "string", "maxLength": model.MAX_KEY_LENGTH},
                            "look only under this key; without it, under the 1,000 most "
                            "recently active keys",
                        ),
                    ],
                )
            },
            "/v1/events": {
                "post": _op(
                    "Ingest Pulse-shaped messages ``{exchange, routingKey, routes|CC, "
                    "payload}``: one, or a list of up to 1000. Each is validated on its own; "
                    "the answer gives each one's outcome.",
                    {
                        "200": _json(_ref("EventResults"), "Per-message outcomes"),
                        **_errors(400, 401, 403, 413, 503),
                    },
                    security=[{"bearer": []}],
                    requestBody={
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": {
                                    "anyOf": [
                                        {"type": "object"},
                                        {"type": "array", "maxItems": 1000},
                                    ]
                                }
                            }
                        },
                    },
                )
            },
            "/v1/bisections": {
                "get": _op(
                    "A key's bisection findings, newest first (by ``located``), a page at a "
                    "time: pass the answer's ``continuationToken`` for the next page (absent "
                    "on the last)",
                    {
                        "200": _json(_ref("BisectionPage"), "A page of the key's findings"),
                        **_errors(400, 503),
                    },
                    parameters=[
                        _KEY_QUERY,
                        _param(
                            "limit",
                            "query",
                            {
                                "type": "integer",
                                "minimum": 1,
                                "maximum": bisections.MAX_PAGE,
                                "default": bisections.PAGE,
                            },
                            "Findings per page",
                        ),
                        _param(
                            "continuationToken",
                            "query",
                            {"type": "string", "pattern": bisections.TOKEN_PATTERN},
                            "Where the previous page ended (its answer's ``continuationToken``)",
                        ),
                    ],
                ),
                "post": _op(
                    "Report a bisection's finding (``coalescer worker --on-primary-failure "
                    "bisect`` does, after a failed primary): the culprit, the last good task, "
                    "each run. Recorded under its key, found by every task it names; the same "
                    "finding again changes nothing.",
                    {
                        "200": _json(_ref("BisectionRecorded"), "The finding as recorded"),
                        "507": _json(
                            {
                                "type": "object",
                                "required": ["error", "new"],
                                "properties": {
                                    "error": {"type": "string"},
                                    "new": {"const": False},
                                },
                            },
                            "Not recorded: COALESCER_MAX_FINDINGS findings are kept",
                        ),
                        **_errors(400, 401, 403, 413, 503),
                    },
                    security=[{"bearer": []}],
                    requestBody={
                        "required": True,
                        "content": {"application/json": {"schema": bisections.FINDING}},
                    },
                ),
            },
            "/v1/bisections/gap": {
                "get": _op(
                    "The tasks of a key the index knows (pending, running or resolved, until "
                    "their deadline passes) ordered strictly between two of its tasks, oldest "
                    "first, each with its latest run's state: what a worker's bisection, which "
                    "ran only the tasks it held, asks before it names a culprit",
                    {
                        "200": _json(_ref("BisectionGap"), "The tasks between"),
                        **_errors(400, 404, 503),
                    },
                    parameters=[
                        _KEY_QUERY,
                        {
                            **_param(
                                "before",
                                "query",
                                {"type": "string", "pattern": _SLUGID},
                                "The newer task (a search's first failing push)",
                            ),
                            "required": True,
                        },
                        _param(
                            "after",
                            "query",
                            {"type": "string", "pattern": _SLUGID},
                            "The older task (its last good push); without it, every task "
                            "below the newer",
                        ),
                    ],
                )
            },
            "/v1/tasks/{taskId}": {
                "get": _op(
                    "Superseding lineage (policies that decide on arrival): what superseded "
                    "the task, the chain to its final primary, and what it superseded; and "
                    "``bisection``, the bisections that name the task, with its role in each",
                    {"200": _json(_ref("Lineage"), "The lineage"), **_errors(400, 404, 503)},
                    parameters=[_TASK_PARAM],
                )
            },
            "/v1/tasks/{taskId}/supersedes": {
                "get": _op(
                    "The state handoff: ``[{taskId, runId, task}]`` of every task it replaces, "
                    "transitively (the shape of ``COALESCER_SUPERSEDES_FILE``)",
                    {
                        "200": _json({"type": "array", "items": {"type": "object"}}, "OK"),
                        **_errors(400, 503),
                    },
                    parameters=[_TASK_PARAM],
                )
            },
            "/v1/policy": {
                "get": _op(
                    "The superseding rules in force and, per key and rule, what they superseded",
                    {"200": _json(_ref("PolicyStats"), "OK"), **_errors(503)},
                )
            },
            "/v1/docker-worker/{key}": {
                "get": _op(
                    _DOCKER_WORKER,
                    {"200": _json(_ref("Supersedes"), "OK"), **_errors(400, 404, 503)},
                    parameters=[_COMPAT_KEY_PARAM, _DOCKER_WORKER_TASK],
                )
            },
            "/v1/docker-worker/{age}/{size}/{key}": {
                "get": _op(
                    _DOCKER_WORKER + "; only the initial task unless more than ``size`` tasks "
                    "are pending and the longest-waiting has waited more than ``age`` seconds",
                    {"200": _json(_ref("Supersedes"), "OK"), **_errors(400, 404, 503)},
                    parameters=[
                        _param("age", "path", _WHOLE, "seconds the oldest must have waited"),
                        _param("size", "path", _WHOLE, "pending tasks needed (more than)"),
                        _COMPAT_KEY_PARAM,
                        _DOCKER_WORKER_TASK,
                    ],
                )
            },
            "/v1/list/{age}/{size}/{key}": {
                "get": _op(
                    "tc-coalesce: pending tasks newest first, or none below the thresholds",
                    {"200": _json(_ref("Supersedes"), "OK"), **_errors(400, 404, 503)},
                    parameters=[
                        _param("age", "path", _WHOLE, "seconds the oldest must have waited"),
                        _param("size", "path", _WHOLE, "pending tasks needed (more than)"),
                        _COMPAT_KEY_PARAM,
                    ],
                )
            },
            "/v1/list/{key}": {
                "get": _op(
                    "tc-coalesce: every pending task of a key, newest first",
                    {"200": _json(_ref("Supersedes"), "OK"), **_errors(400, 404, 503)},
                    parameters=[_COMPAT_KEY_PARAM],
                )
            },
            "/v1/list": {
                "get": _op(
                    'tc-coalesce: ``{"<prefix>.": [keys with pending tasks]}``, among the '
                    "1,000 most recently active keys",
                    {"200": _json(counts, "OK"), **_errors(503)},
                )
            },
            "/v1/stats": {
                "get": _op(
                    "tc-coalesce: counters, as strings, every one always present",
                    {"200": _json(_ref("Stats"), "OK"), **_errors(503)},
                )
            },
            "/v1/ping": {"get": _op("tc-coalesce: alive", {"200": any_json})},
            "/__heartbeat__": {
                "get": _op(
                    "Dockerflow: 200 when Redis answers",
                    {
                        "200": _json(_ref("Heartbeat"), "Healthy"),
                        "503": _json(_ref("Heartbeat"), "Redis does not answer"),
                    },
                ),
                "head": _op(
                    "As GET, without a body",
                    {"200": {"description": "OK"}, "503": {"description": "Unhealthy"}},
                ),
            },
            "/__lbheartbeat__": {
                "get": _op("Dockerflow: the process serves", {"200": any_json}),
                "head": _op("As GET, without a body", {"200": {"description": "OK"}}),
            },
            "/__version__": {"get": _op("Dockerflow: version", {"200": any_json})},
            "/metrics": {
                "get": _op(
                    "Prometheus metrics (text exposition format)",
                    {
                        "200": {
                            "description": "OK",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                )
            },
            "/openapi.json": {"get": _op("This document", {"200": any_json})},
        },
        "components": {
            "schemas": shapes.components(_SLUGID) | _bisection_shapes(),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def _bisection_shapes() -> dict[str, Any]:
    """A finding as recorded (``tasks`` added), and as ``GET /v1/tasks/<taskId>`` gives it
    (``role`` added)."""
    recorded = copy.deepcopy(bisections.FINDING)
    recorded["additionalProperties"] = True  # findings the enforcer records may say more
    recorded["required"] = [*recorded["required"], "tasks"]
    recorded["properties"]["tasks"] = {
        "type": "array",
        "items": {"type": "string", "pattern": _SLUGID},
        "description": "every taskId the finding names",
    }
    named = copy.deepcopy(recorded)
    named["required"].append("role")
    named["properties"]["role"] = {
        "enum": list(bisections.ROLES),
        "description": "the task's role: the failed primary, the culprit, the last good "
        "task, another run of the search, or a task that did not run (stood for)",
    }
    return {
        "Bisection": named,
        "BisectionPage": {
            "type": "object",
            "required": ["key", "findings"],
            "additionalProperties": False,
            "properties": {
                "key": {"type": "string"},
                "findings": {"type": "array", "items": recorded},
                "continuationToken": {
                    "type": "string",
                    "pattern": bisections.TOKEN_PATTERN,
                    "description": "where this page ended; absent on the last page",
                },
            },
        },
        "BisectionRecorded": {
            "type": "object",
            "required": ["finding", "new"],
            "properties": {
                "finding": recorded,
                "new": {
                    "type": "boolean",
                    "description": "false when the same finding was already recorded (a retry)",
                },
            },
        },
    }


async def openapi(request: Request) -> Response:
    return JSON(document())
