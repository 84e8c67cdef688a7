"""Browser pages (Jinja2, no JavaScript needed): the keys, a key, a task, errors.

Each page is also JSON for an API client (``Accept`` without ``text/html``, or
``?format=json``). Pages refresh themselves with a meta refresh.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import re
import time
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

import jinja2
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

from coalescer import keyset, model
from coalescer.errors import InvalidInput
from coalescer.store import Store, views
from coalescer.store import keyset as stored
from coalescer.web import activity, bisections, lineage
from coalescer.web.responses import JSON, error, wants_html

_ENV = jinja2.Environment(
    loader=jinja2.ChoiceLoader(
        [
            jinja2.PackageLoader("coalescer.web", "templates"),
            jinja2.PackageLoader("coalescer", "templates"),  # charts.html
        ]
    ),
    autoescape=jinja2.select_autoescape(["html"]),
    trim_blocks=True,
    lstrip_blocks=True,
)
#: Seconds between a page's own refreshes.
REFRESH = 5


def _span(seconds: int) -> str:
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m {seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d {seconds % 86400 // 3600:02d}h"


def ago(ms: int | float | str | None, now_ms: float | None = None) -> str:
    """``1h 02m``-style time since a millisecond timestamp or an API date-time string."""
    if ms is None:
        return "—"
    if isinstance(ms, str):
        try:
            ms = model.parse_time_ms(ms)
        except InvalidInput:  # a stored record written by another version: say nothing
            return "—"
    now_ms = time.time() * 1000 if now_ms is None else now_ms
    return _span(max(0, int((now_ms - ms) / 1000)))


def until(ms: int | float | None, now_ms: float | None = None) -> str:
    """``1h 02m``-style time to a millisecond timestamp (``passed`` once it has)."""
    if ms is None:
        return "—"
    now_ms = time.time() * 1000 if now_ms is None else now_ms
    left = int((ms - now_ms) / 1000)
    return "passed" if left < 0 else _span(left)


def utc(ms: int | float | None) -> str:
    if ms is None:
        return ""
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def order_text(order: float, rank_tag: str | None = None) -> str:
    """A task's place in its key, as the person reading the page thinks of it: the value of
    the task tag it comes from (``COALESCER_RANK_TAG``), else the time its first run was
    scheduled, in UTC to the millisecond."""
    if rank_tag is not None:
        return f"{rank_tag} {order:g}"
    try:
        when = datetime.fromtimestamp(order / 1000, UTC)
    except (OverflowError, OSError, ValueError):
        return f"{order:g}"
    return (
        "scheduled " + when.strftime("%Y-%m-%d %H:%M:%S.") + f"{when.microsecond // 1000:03d} UTC"
    )


_ENV.filters.update(ago=ago, until=until, utc=utc, order=order_text)


def _style_source() -> str:
    """The pages' one stylesheet: the ``<style>`` element of ``base.html``, verbatim."""
    assert _ENV.loader is not None
    source = _ENV.loader.get_source(_ENV, "base.html")[0]
    found = re.search(r"<style>(.*?)</style>", source, re.DOTALL)
    assert found is not None, "base.html has no <style> element"
    return found[1]


#: The pages run no script and load nothing but their own stylesheet (allowed by its hash),
#: submit their search forms to this service, and are never framed.
CSP = "; ".join(
    [
        "default-src 'none'",
        "style-src 'sha256-"
        + base64.b64encode(hashlib.sha256(_style_source().encode()).digest()).decode()
        + "'",
        "img-src 'self'",
        "form-action 'self'",
        "base-uri 'none'",
        "frame-ancestors 'none'",
    ]
)
HEADERS = {
    "cache-control": "no-store",
    "content-security-policy": CSP,
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
}


def render(request: Request, template: str, status: int = 200, **context: Any) -> HTMLResponse:
    settings = request.app.state.settings
    body = _ENV.get_template(template).render(
        settings=settings,
        root_url=settings.taskcluster_root_url,
        alerts=request.app.state.health.alerts(),
        **context,
    )
    return HTMLResponse(body, status_code=status, headers=HEADERS)


def _store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


def matches(key: str, query: str) -> bool:
    """``?q=``: a case-insensitive substring, or a glob when it has ``*`` or ``?``."""
    if any(c in query for c in "*?["):
        return fnmatch.fnmatchcase(key.lower(), query.lower())
    return query.lower() in key.lower()


async def overview(request: Request) -> Response:
    """The keys, most recently active first, a page (:data:`~coalescer.keyset.PAGE_SIZE`) at
    a time (``?page=``); filtered (``?q=``), the matches among the next
    :data:`~coalescer.keyset.SEARCH_BUDGET` keys examined (``?after=`` goes on)."""
    store = _store(request)
    query = request.query_params.get("q", "").strip()[: model.MAX_KEY_LENGTH]
    page = keyset.page_number(request.query_params.get("page"))
    after = keyset.cursor(request.query_params.get("after"))
    now_ms = int(time.time() * 1000)
    if query:
        found, more = await stored.search(store, lambda k: matches(k, query), after)
        found.sort(key=lambda row: row[1], reverse=True)
        next_page = f"?q={quote(query)}&after={more}" if more else None
    else:
        found, known = await stored.recent(store, *keyset.page_range(page))
        more = known > page * keyset.PAGE_SIZE
        next_page = f"?page={page + 1}" if more else None
    rows = await views.summaries(store, found, now_ms=now_ms)
    totals = await stored.totals(store, now_ms=now_ms)
    retention = request.app.state.settings.retention
    if not wants_html(request):
        return JSON(
            {
                "versions": ["v1"],
                "total": totals.keys,
                "page": None if query else page,
                "next": next_page,
                "keys": [
                    {
                        "key": r.key,
                        "lastActivity": model.format_time_ms(r.activity_ms),
                        "pending": r.pending,
                        "oldestPendingSince": None
                        if r.oldest_since_ms is None
                        else model.format_time_ms(r.oldest_since_ms),
                    }
                    for r in rows
                ],
            }
        )
    return render(
        request,
        "overview.html",
        rows=rows,
        q=query,
        page=page,
        first=(page - 1) * keyset.PAGE_SIZE,
        next_page=next_page,
        totals=totals,
        charts=[] if query else await activity.for_overview(store, retention, now_ms),
        now_ms=now_ms,
        refresh=REFRESH,
    )


async def key_page(request: Request, key: str) -> Response:
    now_ms = int(time.time() * 1000)
    store = _store(request)
    view = await views.key_view(store, key, now_ms=now_ms)
    chart = await activity.for_key(store, request.app.state.settings.retention, key, now_ms)
    return render(
        request,
        "key.html",
        key=key,
        view=view,
        chart=chart,
        bisections=await bisections.recent(store, key),
        now_ms=now_ms,
        refresh=REFRESH,
    )


def explain(task_id: str, under: views.TaskUnderKey) -> dict[str, Any]:
    """What one key tells about a task, for its page: its state, the newest answer that listed
    it, and what follows (superseded by whom, or what it superseded), as far as the service
    knows. The service sees answers and resolutions, not claims: the worker ran the newest
    task *it could claim*, usually the newest listed."""
    record, listing = under.record, under.listing
    doc: dict[str, Any] = {"key": under.key, "known": record is not None}
    if record is not None:
        doc.update(
            runId=record.run_id,
            state=record.state,
            reason=record.reason or None,
            order=record.order,
            deadline=model.format_time_ms(record.deadline_ms),
            pendingSince=model.format_time_ms(record.since_ms),
        )
    doc["listing"] = None
    doc["supersededBy"] = None
    doc["supersedes"] = []
    if listing is None:
        return doc
    doc["listing"] = {
        "at": model.format_time_ms(listing.at_ms),
        "initial": listing.initial,
        "reason": listing.reason,
        "position": listing.position,
        "count": listing.count,
        "newest": listing.newest,
    }
    if listing.count > 1 and listing.newest != task_id:
        doc["supersededBy"] = listing.newest
    elif listing.count > 1:
        doc["supersedes"] = [
            {
                "taskId": other,
                "state": under.listed[other].state if other in under.listed else None,
                "reason": (under.listed[other].reason or None) if other in under.listed else None,
            }
            for other in listing.task_ids
            if other != task_id
        ]
    newest = under.listed.get(listing.newest)
    doc["newestState"] = None if newest is None else newest.state
    return doc


async def task_page(request: Request) -> Response:
    task_id = request.path_params["taskId"]
    try:
        model.check_task_id(task_id)
    except InvalidInput as exc:
        if wants_html(request):
            return error_page(request, 400, str(exc))
        raise
    store = _store(request)
    hint = request.query_params.get("key")
    if hint:
        names = [model.check_key(hint)]
    else:
        listed, _ = await stored.recent(store, 0, keyset.TASK_PAGE_KEYS - 1)
        names = [k for k, _ in listed]
    found = await views.task_view(store, task_id, names)
    if not found:
        where = (
            f"under key {hint!r}"
            if hint
            else f"under the {keyset.TASK_PAGE_KEYS} most recently active keys (add "
            "?key=<key> to look under another)"
        )
        message = (
            f"the service knows nothing of task {task_id} {where}: it has seen no event of it "
            "under a coalescing route and no answer that listed it, or it has been forgotten "
            "since its deadline passed"
        )
        if wants_html(request):
            return error_page(request, 404, message, task_id=task_id)
        return error(404, message)
    keys = [explain(task_id, under) for under in found]
    if not wants_html(request):
        return JSON({"taskId": task_id, "keys": keys})
    return render(
        request,
        "task.html",
        task_id=task_id,
        crumb_key=hint,
        entries=list(zip(keys, found, strict=True)),
        now_ms=int(time.time() * 1000),
        refresh=REFRESH,
        **await lineage.page_context(request, task_id, names),  # policies, bisections
    )


def error_page(request: Request, status: int, message: str, **context: Any) -> Response:
    return render(request, "error.html", status=status, code=status, message=message, **context)
