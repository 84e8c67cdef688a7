"""The yardstick: a bare Starlette JSON endpoint, served the same way as the service, answering
a list as long as the service's (32 taskIds)."""

from __future__ import annotations

import orjson
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

BODY = orjson.dumps({"supersedes": ["fN1SbArXTPSVFNUvaOlinQ"] * 32})


async def endpoint(request):
    request.query_params.get("taskId")
    return Response(BODY, media_type="application/json")


app = Starlette(routes=[Route("/{path:path}", endpoint)])
