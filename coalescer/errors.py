"""The exceptions coalescer raises, one tree::

    CoalescerError
    ├── ConfigError          a setting is missing or malformed (the CLI exits 2)
    │   └── taskgraph.TaskgraphError   a task's coalescing key cannot be made (graph generation)
    ├── InvalidInput         a taskId, key, query parameter or request body is malformed
    │   ├── InvalidEvent     a Pulse message that can never be applied
    │   └── worker.runner.MalformedPayload   a task payload the reference worker cannot run
    ├── AuthError            ingest token missing or wrong
    │   └── IngestDisabled   no ingest token configured
    ├── StoreError           the store (Redis) failed a command
    │   ├── StoreUnavailable unreachable, too slow, or refusing writes for now (full, read-only,
    │   │   │                loading, busy, cluster down): hold and retry (the web edge: 503)
    │   │   └── StoreOverloaded  every connection of the pool busy for too long: load shed, not
    │   │                        an outage (the web edge: 503, counted apart)
    │   └── StoreRejected    refused one command for good (a script error, a wrong type): a bug,
    │                        or an event that can never apply
    ├── ingest.rebuild.ListingFailed         a queue listing could not be read to its end
    ├── ingest.startup.RebuildIncomplete     serve's rebuild of the embedded store missed some
    ├── replay.sources.SourceError           a replay's history cannot be read
    ├── replay.links.LinkError               a replay's link (the queue, the service) did not
    │                                        answer
    ├── web.server.BindError                 the address to serve on cannot be bound
    └── worker.protocol.SupersederError      a superseder's answer cannot be used (the task
                                             then runs alone)

Only ``coalescer.web`` maps these to HTTP status codes. A new class goes in this drawing too:
``tests/unit/test_errors.py`` fails on one that is missing or under another parent.
"""

from __future__ import annotations

from collections.abc import Sequence


class CoalescerError(Exception):
    """Base of every error coalescer raises on purpose."""


class ConfigError(CoalescerError):
    """A setting is missing or malformed."""


class InvalidInput(CoalescerError):
    """Input from a client is malformed; the message says what and why."""


class InvalidEvent(InvalidInput):
    """A Pulse message that can never be applied (bad JSON, fails the schema, no taskId)."""


class AuthError(CoalescerError):
    """The ingest bearer token is missing or wrong."""


class IngestDisabled(AuthError):
    """Ingest is off because no token is configured."""


class StoreError(CoalescerError):
    """The store (Redis) failed a command; ``reason`` labels why, for metrics and logs."""

    reason = "rejected"


class StoreUnavailable(StoreError):
    """The store cannot serve now: unreachable, too slow, or refusing writes (full, read-only,
    loading, busy). It is never the request's or the event's fault: hold it and retry.

    ``reason`` is a short label for metrics and logs (``unreachable``, ``timeout``, ``full``,
    ``read-only``, ...). ``outcomes``, when a write was partly done, holds each event's outcome
    (``None`` for an event that was not applied), so that a caller can say what was applied.
    """

    def __init__(
        self,
        message: str,
        *,
        reason: str = "unreachable",
        outcomes: Sequence[str | None] | None = None,
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.outcomes = outcomes


class StoreOverloaded(StoreUnavailable):
    """Every connection of this process's Redis pool stayed in use for longer than a call may
    wait (a burst of requests): the call is shed. Redis itself is fine; retry shortly."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reason="overloaded")


class StoreRejected(StoreError):
    """The store refused a command for a reason retrying cannot fix (a script error, a key of
    the wrong type): a bug, or an event that can never apply."""
