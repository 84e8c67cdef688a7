"""The JSON shapes of the API's answers, for the OpenAPI document (``openapi.py``).

One convention for time, as in the Taskcluster queue's own answers: an instant is an ISO 8601
date-time in UTC with milliseconds (``2030-01-01T00:00:00.000Z``), a duration an integer
number of milliseconds in a field named ``...Ms``. ``order`` is not a time but the ordering key
(:data:`ORDER`). tc-coalesce's own routes keep its shapes (``/v1/ping``'s ``uptime`` in
seconds, ``/v1/stats``' string values).
"""

from __future__ import annotations

from typing import Any

from coalescer.observe import STAT_COUNTERS

#: An instant.
INSTANT = {
    "type": "string",
    "format": "date-time",
    "pattern": r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$",
}
#: The ordering key of a task within a key.
ORDER = {
    "type": "number",
    "description": "the task's place in its key (tasks sort by order, then taskId): by default "
    "its first run's scheduled time in milliseconds since the epoch; with COALESCER_RANK_TAG, "
    "the value of that numeric task tag (e.g. a push id). Only comparisons between tasks of one "
    "key mean anything",
}


def _instant(description: str, *, nullable: bool = False) -> dict[str, Any]:
    if nullable:
        return {"anyOf": [INSTANT, {"type": "null"}], "description": description}
    return {**INSTANT, "description": description}


def _stats() -> dict[str, Any]:
    counter = {"type": "string", "pattern": "^[0-9]+$"}
    counted = {"type": ["string", "null"], "pattern": "^[0-9]+$"}
    properties: dict[str, Any] = dict.fromkeys(STAT_COUNTERS, counter)
    properties |= {
        "keys": {**counter, "description": "keys known now"},
        "pending_count": {**counted, "description": "pending tasks, as last counted"},
        "coalesced_lists": {**counted, "description": "keys with pending tasks, as last counted"},
        "index_counted_at": _instant(
            "when pending_count and coalesced_lists were counted (null: not yet)", nullable=True
        ),
    }
    return {
        "type": "object",
        "required": sorted(properties),
        "properties": properties,
        "additionalProperties": {"type": "string"},
    }


def components(slugid: str) -> dict[str, Any]:
    """``components.schemas``: the API's answers; ``slugid`` is the taskId pattern."""
    ids = {"type": "array", "items": {"type": "string", "pattern": slugid}}
    nullable_str = {"type": ["string", "null"]}
    decision = {
        "type": "object",
        "required": ["taskId", "runId", "key", "rule", "reason", "at", "action", "state"],
        "properties": {
            "taskId": {"type": "string"},
            "runId": {"type": ["integer", "null"]},
            "key": {"type": "string"},
            "rule": {"type": "string"},
            "reason": {"type": "string"},
            "at": _instant("when the decision was made"),
            "action": nullable_str,
            "state": {"type": "string"},
            "resolution": {"type": ["object", "null"]},
            "victimRunId": {"type": ["integer", "null"]},
        },
    }
    return {
        "Error": {
            "type": "object",
            "required": ["error", "status"],
            "properties": {"error": {"type": "string"}, "status": {"type": "integer"}},
        },
        "Supersedes": {
            "type": "object",
            "required": ["supersedes"],
            "properties": {"supersedes": ids},
        },
        "BisectionGap": {
            "type": "object",
            "required": ["key", "tasks", "knownSince"],
            "properties": {
                "key": {"type": "string"},
                "knownSince": {
                    **INSTANT,
                    "description": "since when the index knows every task (the store was new "
                    "or emptied then; a rebuild restores only what was live): tasks that ended "
                    "before it may be missing from the list",
                },
                "tasks": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["taskId", "runId", "order", "state"],
                        "properties": {
                            "taskId": {"type": "string"},
                            "runId": {"type": "integer", "minimum": 0},
                            "order": ORDER,
                            "state": {
                                "type": "string",
                                "description": "the latest run's state, as the queue names it",
                            },
                        },
                    },
                },
            },
        },
        "KeyListing": {
            "type": "object",
            "required": ["key", "pending"],
            "properties": {
                "key": {"type": "string"},
                "pending": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["taskId", "runId", "order", "pendingSince", "deadline"],
                        "properties": {
                            "taskId": {"type": "string"},
                            "runId": {"type": "integer"},
                            "order": ORDER,
                            "pendingSince": _instant("when its current run became pending"),
                            "deadline": _instant("the task's deadline"),
                        },
                    },
                },
            },
        },
        "Overview": {
            "type": "object",
            "required": ["versions", "total", "keys"],
            "properties": {
                "versions": {"type": "array", "items": {"type": "string"}},
                "total": {"type": "integer", "description": "keys known"},
                "page": {
                    "type": ["integer", "null"],
                    "description": "this page's number (null for a filtered page)",
                },
                "next": {
                    "type": ["string", "null"],
                    "description": "the query string of the next page, if there is one",
                },
                "keys": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["key", "lastActivity", "pending", "oldestPendingSince"],
                        "properties": {
                            "key": {"type": "string"},
                            "lastActivity": _instant("the key's last event"),
                            "pending": {"type": "integer"},
                            "oldestPendingSince": _instant(
                                "since when its longest-waiting task is pending (null: none)",
                                nullable=True,
                            ),
                        },
                    },
                },
            },
        },
        "Task": {
            "type": "object",
            "required": ["taskId", "keys"],
            "properties": {
                "taskId": {"type": "string"},
                "keys": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["key", "known", "listing", "supersededBy", "supersedes"],
                        "properties": {
                            "key": {"type": "string"},
                            "known": {"type": "boolean"},
                            "runId": {"type": "integer"},
                            "state": {"type": "string"},
                            "reason": nullable_str,
                            "order": ORDER,
                            "deadline": _instant("the task's deadline"),
                            "pendingSince": _instant("when its current run became pending"),
                            "listing": {
                                "type": ["object", "null"],
                                "description": "the newest answer that listed the task",
                                "properties": {"at": _instant("when it was given")},
                            },
                            "supersededBy": {
                                **nullable_str,
                                "description": "the newest task of that answer: the likely "
                                "primary, when it is not this task",
                            },
                            "supersedes": {"type": "array", "items": {"type": "object"}},
                            "newestState": nullable_str,
                        },
                    },
                },
            },
        },
        "Heartbeat": {
            "type": "object",
            "required": ["status", "checks", "details", "store"],
            "properties": {
                "status": {"enum": ["ok", "warning", "error"]},
                "checks": {"type": "object", "additionalProperties": {"type": "string"}},
                "store": {"enum": ["embedded", "redis"]},
                "details": {
                    "type": "object",
                    "properties": {
                        "background": {
                            "type": "object",
                            "additionalProperties": {
                                "type": "object",
                                "required": ["status"],
                                "properties": {
                                    "status": {"enum": ["ok", "error"]},
                                    "lastOk": _instant("the task's last good round or start"),
                                    "failures": {"type": "integer"},
                                    "lastError": nullable_str,
                                    "restarts": {"type": "integer"},
                                    "stopped": {"type": "string"},
                                },
                            },
                        }
                    },
                },
            },
        },
        "Stats": _stats(),
        "Lineage": {
            "type": "object",
            "required": ["taskId", "supersededBy", "chain", "finalPrimary", "supersedes"],
            "properties": {
                "taskId": {"type": "string"},
                "supersededBy": {"anyOf": [decision, {"type": "null"}]},
                "chain": ids,
                "finalPrimary": nullable_str,
                "supersedes": {"type": "array", "items": decision},
                "decisions": {"type": "array", "items": decision},
                "bisection": {
                    "type": "array",
                    "items": {"$ref": "#/components/schemas/Bisection"},
                    "description": "the bisections that name the task, newest first "
                    "(absent when none)",
                },
            },
        },
        "PolicyStats": {
            "type": "object",
            "required": ["file", "rules", "keys"],
            "properties": {
                "file": nullable_str,
                "rules": {"type": "array", "items": {"type": "string"}},
                "keys": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["key", "rule", "savedMs"],
                        "properties": {
                            "key": {"type": "string"},
                            "rule": {"type": "string"},
                            "savedMs": {
                                "type": "integer",
                                "description": "worker time saved, estimated from the key's "
                                "recent run durations",
                            },
                        },
                        "additionalProperties": {
                            "type": "integer",
                            "description": "tasks per outcome (superseded, canceled, ...)",
                        },
                    },
                },
            },
        },
        "EventResults": {
            "type": "object",
            "required": ["results"],
            "properties": {
                "results": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["status"],
                        "properties": {
                            "status": {
                                "enum": ["applied", "stale", "ignored", "expired", "invalid"]
                            },
                            "taskId": {"type": "string"},
                            "error": {"type": "string"},
                        },
                    },
                }
            },
        },
    }
