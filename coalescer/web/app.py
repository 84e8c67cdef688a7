"""``create_app(settings, store=None)``: the Starlette application.

With ``store`` given (tests), the app uses it as is; otherwise the lifespan opens the store
named by ``settings.redis_url`` (embedded when unset) and closes it on shutdown.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from coalescer import logs, upkeep
from coalescer.errors import (
    AuthError,
    IngestDisabled,
    InvalidInput,
    StoreError,
    StoreOverloaded,
    StoreUnavailable,
)
from coalescer.health import Health, Supervisor, watch_store
from coalescer.ingest.record import Recorder
from coalescer.logs import Throttled
from coalescer.observe import HTTP_ERRORS, REQUESTS_SHED, STORE_ERRORS, Observer, exposition
from coalescer.settings import Settings
from coalescer.store import Store, open_store
from coalescer.web import api, bisections, lineage, pages, tracing
from coalescer.web.fastpath import FastPath
from coalescer.web.ingest import post_events
from coalescer.web.openapi import openapi
from coalescer.web.responses import error, wants_html
from coalescer.web.tracing import TRACED

log = logging.getLogger(__name__)
#: Allocations between collections of the youngest generation (measured in bench/query.py:
#: about 10% more queries per second than the default 700 on this service's query path).
GC_THRESHOLD = 50_000
#: Seconds between full collections. The threshold counts allocations net of deallocations, and
#: a serving process frees nearly all it allocates: the collector itself hardly ever runs, and
#: reference cycles (an exception kept with its traceback, which a Cluster failover makes by the
#: thousand in redis-py: its error replies, its slot-map refreshes) pile up without end.
COLLECT_SECONDS = 15.0
#: Seconds between writes of the buffered answers (pages, metrics), and between looks at the
#: store's condition (writable, evicting, emptied).
FLUSH_SECONDS = 1.0
WATCH_SECONDS = 5.0


def _error(request: Request, status: int, message: str) -> Response:
    """An error as JSON, or as a page for a browser; counted (errors only: off the hot path)."""
    HTTP_ERRORS.labels(str(status)).inc()
    if wants_html(request):
        return pages.error_page(request, status, message)
    return error(status, message)


async def _invalid(request: Request, exc: Exception) -> Response:
    return _error(request, 400, str(exc))


async def _auth(request: Request, exc: Exception) -> Response:
    return _error(request, 403 if isinstance(exc, IngestDisabled) else 401, str(exc))


#: One line per outage, not one per failed request.
_UNAVAILABLE_LOG = Throttled(log)
#: Seconds a client is told to wait before retrying (``Retry-After``) while the store is down.
RETRY_AFTER = 2


async def _unavailable(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StoreUnavailable)
    STORE_ERRORS.labels(exc.reason).inc()
    _UNAVAILABLE_LOG.log(logging.ERROR, "store unavailable (%s): %s", exc.reason, exc)
    response = _error(
        request, 503, f"the index store (Redis) is unavailable ({exc.reason}); retry shortly"
    )
    response.headers["retry-after"] = str(RETRY_AFTER)
    return response


#: One line per burst shed, not one per request.
_SHED_LOG = Throttled(log)
#: Seconds a client whose request was shed is told to wait before retrying.
RETRY_AFTER_SHED = 1


async def _overloaded(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StoreOverloaded)
    REQUESTS_SHED.labels("store_busy").inc()
    _SHED_LOG.log(logging.WARNING, "shedding requests: %s", exc)
    response = _error(request, 503, f"the service is busy: {exc}")
    response.headers["retry-after"] = str(RETRY_AFTER_SHED)
    return response


async def _http(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = exc.detail
    # Starlette's own (unmatched path, wrong method) say only "Not Found": say what.
    if exc.status_code == 404 and message == "Not Found":
        message = f"no such endpoint: {request.url.path!r}"
    elif exc.status_code == 405 and message == "Method Not Allowed":
        message = f"{request.method} is not allowed on {request.url.path!r}"
    return _error(request, exc.status_code, message)


async def _crash(request: Request, exc: Exception) -> Response:
    rid = tracing.request_id(request.scope)
    log.exception(
        "unhandled error on %s %s", request.method, request.url.path, extra={"request_id": rid}
    )
    HTTP_ERRORS.labels("500").inc()
    response = error(500, f"internal error (request {rid}); the service log has the details")
    response.headers["x-request-id"] = rid
    return response


async def _metrics(request: Request) -> Response:
    settings = request.app.state.settings
    body = await exposition(
        request.app.state.store,
        request.app.state.health,
        multiproc_dir=settings.prometheus_multiproc_dir,
    )
    body += await lineage.exposition(request)
    return Response(
        body,
        media_type="text/plain; version=0.0.4; charset=utf-8",
        headers={"x-content-type-options": "nosniff"},
    )


class App(Starlette):
    """Starlette, with the superseding query's fast path (:mod:`coalescer.web.fastpath`) for
    ``web/server.py``'s protocol to find."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fast_path = FastPath(self.state)


def _traced(path: str, endpoint: Callable[..., Any], *methods: str) -> Route:
    return Route(path, endpoint, methods=list(methods or ("GET",)), middleware=TRACED)


async def collect() -> None:
    """A full collection of what is not frozen (see :data:`COLLECT_SECONDS`)."""
    gc.collect()


def create_app(settings: Settings, store: Store | None = None) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        own = store is None
        app.state.store = store or await open_store(
            settings.redis_url,
            grace_seconds=settings.grace_seconds,
            query_timeout=settings.query_timeout,
        )
        app.state.observer = Observer(app.state.store, retention=settings.retention)
        if settings.record_file is not None:  # appends what POST /v1/events and Pulse apply
            app.state.recorder = Recorder(settings.record_file, settings.record_max_bytes)
        if settings.taskcluster_root_url is not None:  # learns unknown tasks from the queue
            from coalescer.ingest.learn import Learner
            from coalescer.ingest.verify import Verifier

            app.state.learner = Learner.from_settings(settings, app.state.store)
            # Checks events of runs scheduled before the store was emptied (ingest.verify).
            app.state.verifier = Verifier.from_settings(settings, app.state.store)
        logs.adopt_uvicorn()
        supervisor = Supervisor(app.state.health)
        supervisor.every("flush", FLUSH_SECONDS, app.state.observer.flush)
        supervisor.every(
            "watch-store", WATCH_SECONDS, partial(watch_store, app.state.store, app.state.health)
        )
        supervisor.every("collect", COLLECT_SECONDS, collect)
        # Forgets keys whose tasks have all expired; counts the index for /metrics.
        supervisor.every(
            "upkeep",
            settings.upkeep_seconds,
            upkeep.rounds(
                app.state.store, every=settings.upkeep_seconds, retention=settings.retention
            ),
        )
        listener = None
        if settings.pulse_url is not None and settings.redis_url is None:
            # Embedded store: the Pulse consumer must live in this process to share it.
            from coalescer.ingest.pulse import Listener

            listener = Listener.start(
                settings,
                app.state.store,
                app.state.observer,
                supervisor,
                app.state.recorder,
                app.state.verifier,
            )
        enforcer = None
        if app.state.store.embedded:
            # It starts empty: rebuilt from the queue when one is known (TASKCLUSTER_ROOT_URL).
            from coalescer.ingest.startup import start_rebuild

            start_rebuild(settings, app.state.store, supervisor)
            # Likewise the policy enforcer (when a rule decides on arrival and the queue's
            # credentials are set; it logs what is missing otherwise).
            from coalescer.policy.embedded import start_enforcer

            enforcer = start_enforcer(settings, app.state.store)
        # A busy server allocates fast: with the default threshold (700) the collector runs many
        # times a second over the same long-lived objects. Freeze what is loaded by now (it
        # lives as long as the process) and collect the youngest generation less often.
        gc.freeze()
        gc.set_threshold(GC_THRESHOLD, *gc.get_threshold()[1:])
        try:
            yield
        finally:
            if listener is not None:
                await listener.stop()
            if enforcer is not None:
                await enforcer.stop()
            await supervisor.stop()
            try:
                await app.state.observer.flush()
            except StoreError as exc:
                log.warning("could not write the last answers for the pages: %s", exc)
            if app.state.learner is not None:
                await app.state.learner.close()
                app.state.learner = None
            if app.state.verifier is not None:
                await app.state.verifier.close()
                app.state.verifier = None
            if app.state.recorder is not None:
                app.state.recorder.close()
                app.state.recorder = None
            if own:
                await app.state.store.close()

    routes = [
        # The hot path first: one regex decides that a path is a key (see api.KeyPath).
        Route("/{path:keypath}", api.KeyEndpoint(), methods=["GET", "HEAD"]),
        # The others carry a request id and log a line each (see tracing).
        _traced("/", pages.overview),
        _traced("/tasks/{taskId}", pages.task_page),
        _traced("/__heartbeat__", api.heartbeat, "GET", "HEAD"),
        _traced("/__lbheartbeat__", api.lbheartbeat, "GET", "HEAD"),
        _traced("/__version__", api.version),
        _traced("/metrics", _metrics),
        _traced("/openapi.json", openapi),
        _traced("/v1/ping", api.ping),
        _traced("/v1/list", api.compat_keys),
        _traced("/v1/stats", api.compat_stats),
        _traced("/v1/list/{age:int}/{size:int}/{key}", api.compat_list),
        _traced("/v1/list/{key}", api.compat_list_all),
        _traced("/v1/docker-worker/{age:int}/{size:int}/{key}", api.docker_worker),
        _traced("/v1/docker-worker/{key}", api.docker_worker),
        _traced("/v1/events", post_events, "POST"),
        _traced("/v1/bisections", bisections.post_bisection, "POST"),
        _traced("/v1/bisections", bisections.list_bisections),
        _traced("/v1/bisections/gap", bisections.gap),
        _traced("/v1/tasks/{taskId}", lineage.task_lineage),
        _traced("/v1/tasks/{taskId}/supersedes", lineage.task_handoff),
        _traced("/v1/policy", lineage.policy_stats),
        _traced("/{path:path}", api.not_found, "GET", "POST", "HEAD"),
    ]
    app = App(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={
            InvalidInput: _invalid,
            AuthError: _auth,
            StoreOverloaded: _overloaded,
            StoreUnavailable: _unavailable,
            HTTPException: _http,
            Exception: _crash,
        },
    )
    app.state.settings = settings
    app.state.commit = settings.source_commit
    app.state.learner = None  # set by the lifespan when TASKCLUSTER_ROOT_URL is (ingest.learn)
    app.state.verifier = None  # likewise (ingest.verify)
    app.state.health = Health()
    app.state.recorder = None  # set by the lifespan when COALESCER_RECORD_FILE is
    if store is not None:  # usable without running the lifespan (ASGITransport tests)
        app.state.store = store
        app.state.observer = Observer(store, retention=settings.retention)
    return app
