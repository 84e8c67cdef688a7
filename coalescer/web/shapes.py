"""The JSON shapes of the API's answers, for the OpenAPI document (``openapi.py``)."""

from __future__ import annotations

from typing import Any


def components(slugid: str) -> dict[str, Any]:
    """``components.schemas``: the API's answers; ``slugid`` is the taskId pattern."""
    ids = {"type": "array", "items": {"type": "string", "pattern": slugid}}
    nullable_int = {"type": ["integer", "null"]}
    nullable_str = {"type": ["string", "null"]}
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
                            "order": {"type": "number"},
                            "pendingSince": {"type": "number", "description": "epoch seconds"},
                            "deadline": {"type": "number", "description": "epoch seconds"},
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
                        "required": ["key", "activity_ms", "pending", "oldest_pending_ms"],
                        "properties": {
                            "key": {"type": "string"},
                            "activity_ms": {"type": "integer"},
                            "pending": {"type": "integer"},
                            "oldest_pending_ms": nullable_int,
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
                            "order": {"type": "number"},
                            "deadline": {"type": "string"},
                            "pendingSince": {"type": "string"},
                            "listing": {
                                "type": ["object", "null"],
                                "description": "the newest answer that listed the task",
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
            "required": ["status", "checks"],
            "properties": {
                "status": {"enum": ["ok", "error"]},
                "checks": {"type": "object"},
                "store": {"enum": ["embedded", "redis"]},
                "details": {"type": "string"},
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
