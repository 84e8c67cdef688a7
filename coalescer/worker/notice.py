"""What a superseded run tells the people who open it. Pure: text from plain data.

A superseded run never ran its command, so it has no log of its own. The Taskcluster UI and
Treeherder open ``public/logs/live_backing.log`` first; a superseded (or released) run gets a
short one there (:func:`render`) saying which task superseded it, where that task sits in the
key's order, where to see both, and which rule decided.
"""

from __future__ import annotations

import dataclasses
import re
from urllib.parse import SplitResult, parse_qsl, quote, urlsplit

from coalescer.model import keys_from_routes

#: The run's log as the Taskcluster UI and Treeherder look for it.
LOG = "public/logs/live_backing.log"
TEXT = "text/plain; charset=utf-8"
#: How a resolution reads in the queue's terms (state/reason).
_STATES = {"canceled": "exception/canceled"}


@dataclasses.dataclass(frozen=True, slots=True)
class Why:
    """Why a run was superseded, as the side that superseded it knows it.

    ``rule``: what decided (the superseder's answer, a policy rule's reason); ``order``: where
    the run and its primary sit in the key's order, when known; ``service``: the superseder
    service's base URL, for a link to the task's page there.
    """

    rule: str
    order: str | None = None
    service: str | None = None


def ordinal(n: int) -> str:
    """``1st``, ``2nd``, ``3rd``, ``4th``, ``11th``, ``22nd``..."""
    if 10 <= n % 100 <= 20:
        return f"{n}th"
    return f"{n}{ {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th') }"


def listed_order(
    listed: list[str],
    task_id: str,
    primary: str,
    role: str = "the newest this worker could claim",
) -> str | None:
    """Where ``task_id`` and ``primary`` (the task that superseded it, ``role`` saying what it
    is) sit in the superseder's list (oldest first)."""
    if task_id not in listed or primary not in listed:
        return None
    return (
        f"{ordinal(listed.index(task_id) + 1)} of {len(listed)} tasks listed oldest first; "
        f"{primary} is {ordinal(listed.index(primary) + 1)}, {role}"
    )


def located(
    primary: str,
    held: int,
    runs: int,
    culprit: tuple[str, int] | None,
    last_good: tuple[str, int] | None,
    stand_in: str,
    suspect: tuple[str, int] | None = None,
) -> str:
    """The rule of a run superseded after a bisection (``--on-primary-failure bisect``): what
    the search found, and why ``stand_in``'s result stands for the run. ``suspect``: the first
    failing task, when the search ended without naming it the culprit."""
    if culprit is None and suspect is not None:
        found = (
            f"the primary {primary} failed; bisecting the {held} older tasks it held ({runs} more "
            f"runs) found task {suspect[0]} run {suspect[1]} the first failing of them, but named "
            "no culprit: a task between it and the last good did not pass, or the runs allowed "
            "were spent. "
        )
        if stand_in == suspect[0]:
            return found + "This task is newer than that task, whose failure stands for it"
        return found + "This task is older than the last good task, whose pass stands for it"
    if culprit is None:
        return (
            f"the primary {primary} failed, then passed when run again: the failure was "
            f"intermittent, and its passing result stands for the {held} older tasks it held"
        )
    good = f"task {last_good[0]} run {last_good[1]}" if last_good else "none of them"
    found = (
        f"the primary {primary} failed; bisecting the {held} older tasks it held ({runs} more runs) "
        f"located the first failing task, the culprit: task {culprit[0]} run {culprit[1]}; "
        f"the last good: {good}. "
    )
    if stand_in == culprit[0]:
        return found + "This task is newer than the culprit, whose failure stands for it"
    return found + "This task is older than the last good task, whose pass stands for it"


#: Query parameters a URL keeps in a log (the thresholds and the protocol's own), and what
#: their values may look like; any other parameter, or another value, is left out.
_SHOWN_PARAMS = ("age", "size", "taskId")
_PLAIN_VALUE = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: What a host may look like in a log: a name, an IPv4 or a bracketed IPv6 address.
_PLAIN_HOST = re.compile(r"[A-Za-z0-9._-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]")


def _plain_origin(parts: SplitResult) -> str:
    """``scheme://host[:port]`` of ``parts`` as a log may show it: never a user or password,
    and a host that is not a plain name shows as ``invalid-host``."""
    host = parts.netloc.rpartition("@")[2]
    name, _, port = host.rpartition(":") if not host.endswith("]") else (host, "", "")
    if not name or (port and not port.isdigit()):
        name, port = host, ""
    if not _PLAIN_HOST.fullmatch(name):
        name, port = "invalid-host", ""
    scheme = parts.scheme if parts.scheme in ("http", "https") else "http"
    return f"{scheme}://{name.lower()}{':' + port if port else ''}"


def _plain_path(path: str) -> str:
    """``path`` percent-encoded but for letters, digits and ``/ - . _ ~ % + : @`` (what a
    coalescing key may hold): no viewer of a log renders it as Markdown, HTML or a link of its
    own."""
    return quote(path, safe="/%+:@")


def shown_url(url: str) -> str:
    """``url`` as it may be written in a log that other people read (a superseded run's
    ``live_backing.log``): its origin without credentials, its path escaped, and of its query
    only the thresholds and the ``taskId`` with plain values. A ``supersederUrl`` is the task
    author's text: copied verbatim it could put Markdown, HTML or a link into another task's
    log, inside coalescer's own explanation."""
    parts = urlsplit(url)
    kept = [
        (name, value)
        for name, value in parse_qsl(parts.query, keep_blank_values=True)
        if name in _SHOWN_PARAMS and _PLAIN_VALUE.fullmatch(value)
    ]
    query = "&".join(f"{name}={value}" for name, value in kept)
    return _plain_origin(parts) + _plain_path(parts.path) + (f"?{query}" if query else "")


def service_base(url: str, routes: list[str], prefix: str) -> str | None:
    """The superseder service's base URL, from a ``supersederUrl`` that names one of the
    task's keys (``<base>/<key path>``, ``<base>/v1/docker-worker/<key>``,
    ``<base>/v1/list/<age>/<size>/<key>``); None when the URL names none of them."""
    parts = urlsplit(url)
    path = parts.path.rstrip("/")
    for key in keys_from_routes(routes, prefix):
        for tail in (key.replace(".", "/"), key):
            if not path.endswith("/" + tail):
                continue
            base = path[: -len(tail) - 1]
            for compat in ("/v1/docker-worker", "/v1/list"):
                if compat in base:
                    base = base[: base.index(compat)]
            return (_plain_origin(parts) + _plain_path(base)).rstrip("/")
    return None


def render(
    task_id: str,
    run_id: int,
    primary: tuple[str, int],
    how: str,
    reason: str,
    why: Why,
    *,
    root_url: str | None,
    by: str,
) -> bytes:
    """The ``live_backing.log`` of run ``run_id`` of ``task_id``, superseded by ``primary``
    (``how`` it was ended and the ``reason`` for that resolution) or released (``how`` is
    ``released``: it runs again). ``by`` names who resolved it (worker or enforcer)."""
    p_task, p_run = primary
    released = how == "released"
    lines = (
        [
            f"This run did not run its command: it was given back to the queue and the task "
            f"will run again ({reason}).",
            f"It would have been superseded by task {p_task} run {p_run}.",
        ]
        if released
        else [
            f"This run did not run its command: task {p_task} run {p_run} superseded it, and "
            "that task's result stands for this one.",
            f"Resolved {_STATES.get(how, how)}: {reason}.",
            "Resolved this way, the run never reads as a success: look at the superseding "
            "task's result."
            if how != "completed"
            else "Resolved this way, the run reads as a success wherever only its state is "
            "looked at, although it did not run: look at the superseding task's result.",
        ]
    )
    lines.append(f"Why: {why.rule}")
    if why.order:
        lines.append(f"Order: this task is {why.order}.")
    if root_url:
        lines.append(f"Superseding task: {root_url.rstrip('/')}/tasks/{p_task}")
    if why.service:
        lines.append(f"This task on the superseder: {why.service}/tasks/{task_id}")
    lines.append(f"Resolved by {by}.")
    return "".join(f"[coalescer] {line}\n" for line in lines).encode()
