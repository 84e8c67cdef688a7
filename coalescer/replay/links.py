"""Where the replay reads what superseded a recorded run: the run's
``public/superseded-by.json`` on the queue, and a coalescer service's lineage (``GET
/v1/tasks/<taskId>``). IO only: what a link means is :mod:`coalescer.replay.runs`'s to say.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import orjson

from coalescer.errors import CoalescerError
from coalescer.replay.runs import ENFORCER, Identity, Link, Ref

ARTIFACT = "public/superseded-by.json"
#: Links read at once.
CONCURRENCY = 8
#: Lineage states in which the victim's run was ended for its primary.
_ENDED = frozenset({"superseded", "canceled"})


class LinkError(CoalescerError):
    """A link could not be read: the queue or the service did not answer."""


@dataclasses.dataclass(frozen=True)
class Evidence:
    """How a source tells superseded runs: the identities the superseding side resolves as
    (the enforcer's), a queue to read each candidate run's ``superseded-by.json`` from (a
    ``taskcluster.Queue``; none: not read), and a coalescer service to ask for its lineage
    (none: not asked)."""

    identities: frozenset[Identity] = frozenset({ENFORCER})
    queue: Any = None
    service: str | None = None
    timeout: float = 30.0

    def links(self, refs: Sequence[Ref]) -> dict[Ref, Link]:
        """The links of the runs ``refs`` that the queue's artifacts or the service's lineage
        show ended for another task."""
        found: dict[Ref, Link] = {}
        if not refs or (self.queue is None and self.service is None):
            return found
        with httpx.Client(timeout=self.timeout, follow_redirects=True) as http:
            if self.queue is not None:
                found |= _read(refs, lambda ref: _artifact(http, self.queue, ref))
            if self.service is not None:
                left = [ref for ref in refs if ref not in found]
                found |= _read(left, lambda ref: _lineage(http, str(self.service), ref))
        return found

    def findings(self, keys: Collection[str]) -> list[dict[str, Any]]:
        """Every finding the service holds for ``keys`` (``GET /v1/bisections?key=``, page
        by page); none without a service."""
        if self.service is None:
            return []
        found: list[dict[str, Any]] = []
        url = f"{self.service.rstrip('/')}/v1/bisections"
        with httpx.Client(timeout=self.timeout, follow_redirects=True) as http:
            for key in sorted(keys):
                query = {"key": key}
                while True:
                    try:
                        response = http.get(url, params=query)
                    except httpx.HTTPError as exc:
                        raise LinkError(f"cannot ask {url}: {exc}") from exc
                    if response.is_error:
                        raise LinkError(f"cannot ask {url}?key={key}: HTTP {response.status_code}")
                    page = orjson.loads(response.content)
                    found += page.get("findings") or []
                    if not page.get("continuationToken"):
                        break
                    query = {"key": key, "continuationToken": page["continuationToken"]}
        return found

    @property
    def reads_links(self) -> bool:
        return self.queue is not None or self.service is not None


def _read(refs: Collection[Ref], one: Callable[[Ref], Link | None]) -> dict[Ref, Link]:
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        answers = list(pool.map(one, refs))
    return {ref: by for ref, by in zip(refs, answers, strict=True) if by is not None}


def _artifact(http: httpx.Client, queue: Any, ref: Ref) -> Link | None:
    """The link a run's ``superseded-by.json`` makes (to no primary when it names none),
    None when the run has none. A public artifact: read without credentials, as a browser
    would."""
    task_id, run_id = ref
    url = queue.buildUrl("getArtifact", task_id, str(run_id), ARTIFACT)
    try:
        response = http.get(url)
    except httpx.HTTPError as exc:
        raise LinkError(f"cannot read {ARTIFACT} of {task_id}/{run_id}: {exc}") from exc
    if response.status_code in (404, 424):  # none, or an error artifact in its place
        return None
    if response.is_error:
        raise LinkError(
            f"cannot read {ARTIFACT} of {task_id}/{run_id}: HTTP {response.status_code}"
        )
    try:
        body = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        return Link()
    primary = body.get("taskId") if isinstance(body, dict) else None
    return Link(primary if isinstance(primary, str) else "")


def _lineage(http: httpx.Client, service: str, ref: Ref) -> Link | None:
    """What a service's lineage says ended this run: a decision that superseded or canceled
    it for its primary, or a cascade from a task it depends on; None when none did."""
    task_id, run_id = ref
    url = f"{service.rstrip('/')}/v1/tasks/{task_id}"
    try:
        response = http.get(url, headers={"accept": "application/json"})
    except httpx.HTTPError as exc:
        raise LinkError(f"cannot ask {url}: {exc}") from exc
    if response.status_code == 404:
        return None
    if response.is_error:
        raise LinkError(f"cannot ask {url}: HTTP {response.status_code}")
    for decision in orjson.loads(response.content).get("decisions") or []:
        if decision.get("victimRunId") == run_id and decision.get("state") in _ENDED:
            cascade = decision.get("action") == "cascade"
            return Link(str(decision.get("taskId") or ""), cascade=cascade)
    return None
