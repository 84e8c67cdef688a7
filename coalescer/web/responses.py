"""JSON responses by orjson, and content negotiation between browsers and API clients."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response


class JSON(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def wants_html(request: Request) -> bool:
    """A browser asks for ``text/html`` first; API clients and curl don't."""
    accept = request.headers.get("accept", "")
    return "text/html" in accept and request.query_params.get("format") != "json"


def error(status: int, message: str, **extra: Any) -> JSON:
    return JSON({"error": message, "status": status, **extra}, status_code=status)
