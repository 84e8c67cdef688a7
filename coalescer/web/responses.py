"""JSON responses by orjson, content negotiation between browsers and API clients, and the
headers that keep a browser from reading a response as something else."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

#: On every response: a browser must not guess a type other than the one sent.
NOSNIFF = (b"x-content-type-options", b"nosniff")


class JSON(Response):
    media_type = "application/json"

    def init_headers(self, headers: Mapping[str, str] | None = None) -> None:
        super().init_headers(headers)
        self.raw_headers.append(NOSNIFF)

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def wants_html(request: Request) -> bool:
    """A browser asks for ``text/html`` first; API clients and curl don't."""
    accept = request.headers.get("accept", "")
    return "text/html" in accept and request.query_params.get("format") != "json"


def error(status: int, message: str, **extra: Any) -> JSON:
    return JSON({"error": message, "status": status, **extra}, status_code=status)
