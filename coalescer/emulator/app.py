"""The emulator's HTTP edge: the queue API under ``/api/queue/v1/``, plus its own controls.

Routes, methods and input schemas come from the saved ``api.json`` reference, so the official
``taskcluster`` client finds every endpoint where a real queue has it. Requests are validated
against the request schemas (``reportException`` against the v39 one when ``legacy``), errors
have the real queue's shape ``{"code", "message", "requestInfo"}``, and Hawk signatures are
accepted without checking their MACs (see :mod:`coalescer.emulator.credentials`).

Besides the queue API:

* ``GET|PUT /emulator/v1/blobs/<taskId>/<runId>/<name>``: where ``s3`` artifacts' ``putUrl``
  and download URLs point;
* ``GET /emulator/v1/clock``, and ``POST /emulator/v1/clock`` ``{"advance": seconds}`` when the
  clock is controllable;
* ``GET /emulator/v1/messages``: the Pulse messages published so far (newest last).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any
from urllib.parse import quote

import orjson
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from coalescer.emulator import artifacts
from coalescer.emulator.clock import format_time
from coalescer.emulator.credentials import Hawk, parse_hawk
from coalescer.emulator.messages import select
from coalescer.emulator.model import QueueError
from coalescer.emulator.runtime import Emulator
from coalescer.emulator.state import Outcome, QueueState
from coalescer.schemas import errors as schema_errors

_SLUG = r"^[A-Za-z0-9_-]{8}[Q-T][A-Za-z0-9_-][CGKOSWaeimquy26-][A-Za-z0-9_-]{10}[AQgw]$"
_IDENTIFIER = r"^[a-zA-Z0-9-_]{1,38}$"
#: What each URL parameter must look like (the real queue's ``params`` patterns).
PARAM_PATTERNS = {
    "taskId": _SLUG,
    "taskGroupId": _SLUG,
    "runId": r"^[0-9]{1,4}$",
    "taskQueueId": r"^[a-zA-Z0-9-_]{1,38}/[a-z]([-a-z0-9]{0,36}[a-z0-9])?$",
    "provisionerId": _IDENTIFIER,
    "workerType": _IDENTIFIER,
    "workerGroup": _IDENTIFIER,
    "workerId": _IDENTIFIER,
    "name": r"^[\x20-\x7e]+$",
}
#: URL parameters that may contain ``/`` (the client percent-encodes it; the server decodes).
_PATH_PARAMS = {"taskQueueId", "name"}


class JSON(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


@dataclasses.dataclass
class Call:
    """One API request, parsed and validated, as an endpoint handler sees it."""

    request: Request
    emulator: Emulator
    name: str
    params: dict[str, str]
    body: Any
    hawk: Hawk | None

    @property
    def state(self) -> QueueState:
        return self.emulator.state

    @property
    def task_id(self) -> str:
        return self.params["taskId"]

    @property
    def run_id(self) -> int:
        return int(self.params["runId"])

    def apply(self, operation: Callable[[datetime], Outcome]) -> Any:
        """Change the state (see :meth:`Emulator.apply`); returns the response body."""
        return self.emulator.apply(operation)

    def read(self, query: Callable[[], Any]) -> Any:
        """Answer from the state, after applying whatever became due."""
        return self.emulator.read(query)

    def authorize_run(self, scope: str) -> None:
        """Refuse expired temporary credentials (401), and another run's, which lack ``scope``
        (e.g. ``queue:create-artifact``) for this run (403)."""
        if self.hawk is None:
            return
        task_id, run_id, client_id = self.task_id, self.run_id, self.hawk.client_id

        def check(now: datetime) -> Outcome:
            self.state.check_credentials(client_id, scope, task_id, run_id, now)
            return None, []

        self.apply(check)

    def blob_url(self, task_id: str, run_id: int, name: str) -> str:
        """Where an ``s3`` artifact's bytes are PUT and fetched, on this emulator."""
        base = f"{self.request.url.scheme}://{self.request.url.netloc}"
        return f"{base}/emulator/v1/blobs/{task_id}/{run_id}/{quote(name, safe='/')}"


Handler = Callable[[Call], Awaitable[Any]]


def _error(exc: QueueError, name: str, seen: dict[str, Any], emulator: Emulator) -> JSON:
    time = format_time(emulator.clock.now())
    message = (
        f"{exc.message}\n\n---\n\n* method:     {name}\n* errorCode:  {exc.code}\n"
        f"* statusCode: {exc.status}\n* time:       {time}"
    )
    info = {"method": name, "params": seen["params"], "payload": seen["payload"], "time": time}
    return JSON({"code": exc.code, "message": message, "requestInfo": info}, status_code=exc.status)


def _route_path(route: str) -> str:
    """``/task/<taskId>/artifacts/<name>`` → ``/task/{taskId}/artifacts/{name:path}``."""

    def convert(match: re.Match[str]) -> str:
        return f"{{{match[1]}:path}}" if match[1] in _PATH_PARAMS else f"{{{match[1]}}}"

    return re.sub(r"<(\w+)>", convert, route)


def api_route(entry: dict[str, Any], handler: Handler, emulator: Emulator) -> Route:
    """A Starlette route for one ``api.json`` entry, wrapping ``handler`` in the queue's rules."""
    name = entry["name"]
    schema = entry.get("input", "").removeprefix("v1/").removesuffix(".json#") or None
    legacy = emulator.options.legacy and name == "reportException"

    async def endpoint(request: Request) -> Response:
        params = {k: str(v) for k, v in request.path_params.items()}
        seen: dict[str, Any] = {"params": params, "payload": {}}
        try:
            for key, value in params.items():
                if key in PARAM_PATTERNS and not re.fullmatch(PARAM_PATTERNS[key], value):
                    raise QueueError(
                        "InvalidRequestArguments", f"Invalid URL parameter {key}: {value!r}"
                    )
            body: Any = None
            if schema is not None:
                raw = await request.body()
                try:
                    body = orjson.loads(raw) if raw else {}
                except orjson.JSONDecodeError:
                    raise QueueError("MalformedPayload", "Failed to parse JSON payload") from None
                # Defaults filled in, as the real queue's validator does: its handlers and its
                # error bodies' requestInfo.payload see the completed request.
                problems = schema_errors(schema, body, legacy=legacy, fill_defaults=True)
                seen["payload"] = body
                if problems:
                    raise QueueError(
                        "InputValidationError",
                        f"Request payload must match the schema `{schema}.json`:\n"
                        + "\n".join(problems),
                    )
            hawk = parse_hawk(request.headers.get("authorization"))
            result = await handler(Call(request, emulator, name, params, body, hawk))
        except QueueError as exc:
            return _error(exc, name, seen, emulator)
        return result if isinstance(result, Response) else JSON(result)

    return Route(
        _route_path(entry["route"]), endpoint, methods=[entry["method"].upper()], name=name
    )


def _plain_error(exc: QueueError) -> JSON:
    return JSON({"code": exc.code, "message": exc.message}, status_code=exc.status)


def control_routes(emulator: Emulator) -> list[Route]:
    async def clock(request: Request) -> Response:
        if request.method == "POST":
            if not emulator.options.controllable_clock:
                message = "the clock is not controllable: start with --controllable-clock"
                return _plain_error(QueueError("ResourceNotFound", message))
            try:
                advance = float(orjson.loads(await request.body())["advance"])
                if advance < 0:
                    raise ValueError(advance)
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                return _plain_error(
                    QueueError("InputError", 'expected {"advance": <non-negative seconds>}')
                )
            emulator.advance(advance)
        return JSON({"now": format_time(emulator.clock.now())})

    async def messages(request: Request) -> Response:
        kind, task_id = request.query_params.get("exchange"), request.query_params.get("taskId")
        return JSON({"messages": select(emulator.publisher.published, kind, task_id)})

    async def blob(request: Request) -> Response:
        task_id, run_id = request.path_params["taskId"], int(request.path_params["runId"])
        name = request.path_params["name"]
        try:
            if request.method == "PUT":
                data, content_type = await request.body(), request.headers.get("content-type")

                def upload(now: datetime) -> Outcome:
                    found = emulator.state.task(task_id)
                    artifacts.store_upload(found, run_id, name, data, content_type, now)
                    return None, []

                emulator.apply(upload)
                return Response(status_code=200)
            found = emulator.state.tasks.get(task_id)
            artifact = found.artifacts.get((run_id, name)) if found else None
            if artifact is None or artifact.data is None:
                raise QueueError("NoSuchKey", "The specified key does not exist.")
            return Response(artifact.data, headers={"content-type": artifact.data_type or ""})
        except QueueError as exc:
            return _plain_error(exc)

    return [
        Route("/emulator/v1/clock", clock, methods=["GET", "POST"]),
        Route("/emulator/v1/messages", messages, methods=["GET"]),
        Route("/emulator/v1/blobs/{taskId}/{runId:int}/{name:path}", blob, methods=["GET", "PUT"]),
    ]


async def not_found(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = "ResourceNotFound" if exc.status_code == 404 else "InvalidRequestArguments"
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return JSON({"code": code, "message": message}, status_code=exc.status_code)


async def internal_error(request: Request, exc: Exception) -> Response:
    # An emulator bug: say so in the queue's error shape (the traceback goes to the log).
    message = f"the queue emulator failed on {request.method} {request.url.path}: {exc!r}"
    return JSON({"code": "InternalServerError", "message": message}, status_code=500)
