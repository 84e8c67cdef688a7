"""Temporary task credentials, and just enough Hawk to tell which credentials signed a request.

The emulator does not verify MACs: it trusts every signature. What it does check is that
credentials *it issued* on claimTask/claimWork/reclaimTask are used for their own task run and
before they expire, so a test can catch a worker that keeps using stale credentials.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import hmac
import json
import re
import secrets
from datetime import datetime, timedelta
from typing import Any

from coalescer.emulator.clock import format_time
from coalescer.emulator.model import QueueError

#: The made-up identity that signs certificates (the real queue uses its own clientId).
ISSUER = "static/taskcluster/queue"
_SIGNING_KEY = secrets.token_bytes(32)
_HAWK_FIELD = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclasses.dataclass(frozen=True)
class Issued:
    """What the emulator remembers of a set of temporary credentials it handed out."""

    client_id: str
    task_id: str
    run_id: int
    expiry: datetime


@dataclasses.dataclass(frozen=True)
class Hawk:
    """The parts of a Hawk ``Authorization`` header the emulator looks at."""

    client_id: str
    ext: dict[str, Any] | None = None


def _slug(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def issue(
    task_id: str,
    run_id: int,
    worker_group: str,
    worker_id: str,
    taken_until: datetime,
    scopes: list[str],
    *,
    now: datetime,
    grace: timedelta,
) -> tuple[dict[str, str], Issued]:
    """Credentials for one claim (``task-credentials.json``) and the record to check them by.

    The clientId follows the real queue's ``task-client/<taskId>/<runId>/on/<workerGroup>/
    <workerId>/until/<takenUntil seconds>``; they expire ``grace`` after ``takenUntil``.
    """
    millis = round(taken_until.timestamp() * 1000)
    until = str(millis // 1000) if millis % 1000 == 0 else str(millis / 1000)  # as JS prints it
    client_id = "/".join(
        ["task-client", task_id, str(run_id), "on", worker_group, worker_id, "until", until]
    )
    expiry = taken_until + grace
    seed = _slug(secrets.token_bytes(32)) + _slug(secrets.token_bytes(32))
    certificate: dict[str, Any] = {
        "version": 1,
        "scopes": [
            f"queue:reclaim-task:{task_id}/{run_id}",
            f"queue:resolve-task:{task_id}/{run_id}",
            f"queue:create-artifact:{task_id}/{run_id}",
            *scopes,
        ],
        "start": int(now.timestamp() * 1000),
        "expiry": int(expiry.timestamp() * 1000),
        "seed": seed,
        "issuer": ISSUER,
    }
    signed = "\n".join(f"{k}:{certificate[k]}" for k in ("version", "seed", "start", "expiry"))
    certificate["signature"] = base64.b64encode(
        hmac.new(_SIGNING_KEY, signed.encode(), hashlib.sha256).digest()
    ).decode()
    access_token = _slug(hmac.new(_SIGNING_KEY, seed.encode(), hashlib.sha256).digest())
    credentials = {
        "clientId": client_id,
        "accessToken": access_token,
        "certificate": json.dumps(certificate, separators=(",", ":")),
    }
    return credentials, Issued(client_id, task_id, run_id, expiry)


def parse_hawk(header: str | None) -> Hawk | None:
    """The clientId (and decoded ``ext``) of a Hawk header; None when unsigned or not Hawk."""
    if not header or not header.startswith("Hawk "):
        return None
    fields = {key: value.replace('\\"', '"') for key, value in _HAWK_FIELD.findall(header)}
    client_id = fields.get("id")
    if not client_id:
        raise QueueError("AuthenticationFailed", "Hawk header without an id")
    ext: dict[str, Any] | None = None
    if fields.get("ext"):
        # The taskcluster client puts base64url(JSON) here, holding the certificate if any.
        raw = fields["ext"]
        try:
            decoded = json.loads(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
        except (binascii.Error, ValueError):
            decoded = None
        ext = decoded if isinstance(decoded, dict) else None
    return Hawk(client_id, ext)


def check(issued: Issued | None, scope: str, task_id: str, run_id: int, now: datetime) -> None:
    """Refuse emulator-issued credentials that expired (AuthenticationFailed, 401) or belong to
    another task run (InsufficientScopes, 403: their certificate lacks ``scope``, e.g.
    ``queue:create-artifact``, for this run)."""
    if issued is None:
        return  # permanent credentials, or none: accepted
    if now >= issued.expiry:
        raise QueueError(
            "AuthenticationFailed",
            f"temporary credentials {issued.client_id} expired at {format_time(issued.expiry)}; "
            "use the newest credentials from reclaimTask",
        )
    if (issued.task_id, issued.run_id) != (task_id, run_id):
        raise QueueError(
            "InsufficientScopes",
            f"Client ID {issued.client_id} does not have sufficient scopes and is missing the "
            f"scope {scope}:{task_id}/{run_id} (its temporary credentials are for "
            f"{issued.task_id}/{issued.run_id})",
        )
