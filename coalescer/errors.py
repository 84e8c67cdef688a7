"""The exceptions coalescer raises, one tree::

    CoalescerError
    ├── ConfigError          a setting is missing or malformed (the CLI exits 2)
    ├── InvalidInput         a taskId, key, query parameter or request body is malformed
    │   ├── InvalidEvent     a Pulse message that can never be applied
    │   └── worker.runner.MalformedPayload   a task payload the reference worker cannot run
    ├── AuthError            ingest token missing or wrong
    │   └── IngestDisabled   no ingest token configured
    ├── StoreUnavailable     Redis cannot be reached (the web edge answers 503)
    ├── ingest.rebuild.ListingFailed         a queue listing could not be read to its end
    └── worker.protocol.SupersederError      a superseder's answer cannot be used (the task
                                             then runs alone)

Only ``coalescer.web`` maps these to HTTP status codes.
"""

from __future__ import annotations


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


class StoreUnavailable(CoalescerError):
    """The store (Redis) cannot be reached or failed mid-command."""
