"""The worker and the enforcer never log a request's full URL: an artifact's ``putUrl`` on the
real queue is presigned, its signature in the query. httpx logs every request's URL at INFO,
and an HTTP error's message holds it: the log handler keeps the method, host and path only, at
every level."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from coalescer import logs
from coalescer.worker.resolve import put_artifact

SIGNATURE = "4f2a9c0d1e7b8a6f5c3d2e1f0a9b8c7d6e5f4a3b2c1d0e9f8a7b6c5d4e3f2a1b"
PRESIGNED = (
    "https://taskcluster-artifacts.s3.us-west-2.amazonaws.com/E5SBRfo-RfOIxh0V4187Qg/0/public/"
    "logs/live_backing.log?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIAEXAMPLE%2F"
    "20261127%2Fus-west-2%2Fs3%2Faws4_request&X-Amz-Date=20261127T070000Z&X-Amz-Expires=2700"
    f"&X-Amz-SignedHeaders=host&X-Amz-Signature={SIGNATURE}"
)
PATH = "/E5SBRfo-RfOIxh0V4187Qg/0/public/logs/live_backing.log"


@pytest.fixture(params=[True, False], ids=["json", "text"])
def logged(request: pytest.FixtureRequest) -> Iterator[io.StringIO]:
    """Every line logged, at DEBUG, through the handler the CLI installs."""
    stream = io.StringIO()
    root, http = logging.getLogger(), logging.getLogger("httpx")
    saved = root.handlers[:], root.level, http.level
    root.handlers[:] = [logs.make_handler(json=request.param, stream=stream)]
    root.setLevel(logging.DEBUG)
    # As a worker's process has it: some commands (replay, demo) quiet httpx in theirs, and an
    # earlier test in this process may have run one.
    http.setLevel(logging.NOTSET)
    try:
        yield stream
    finally:
        root.handlers[:], level, http_level = saved
        root.setLevel(level)
        http.setLevel(http_level)


def _claim() -> Any:
    async def create_artifact(*args: Any) -> dict[str, Any]:
        return {"storageType": "s3", "putUrl": PRESIGNED}

    queue = SimpleNamespace(createArtifact=create_artifact)
    return SimpleNamespace(
        task_id="E5SBRfo-RfOIxh0V4187Qg", run_id=0, task={"expires": "x"}, queue=queue
    )


@pytest.mark.parametrize("status", [200, 403])
async def test_a_presigned_upload_is_logged_with_method_host_and_path_only(
    logged: io.StringIO, status: int
) -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(status))
    async with httpx.AsyncClient(transport=transport) as http:
        try:
            await put_artifact(http, _claim(), "public/logs/live_backing.log", b"x")
        except httpx.HTTPStatusError as exc:
            # As the resolver logs a failed upload (worker.resolve): the error names the URL.
            logging.getLogger("coalescer.worker").warning("no log on the run: %s", exc)
            logging.getLogger("coalescer.worker").debug("why", exc_info=exc)
    text = logged.getvalue()
    assert f"PUT https://taskcluster-artifacts.s3.us-west-2.amazonaws.com{PATH}" in text, text
    for secret in (SIGNATURE, "X-Amz-Credential", "AKIAEXAMPLE", "X-Amz-Signature"):
        assert secret not in text, text
    if status == 403:
        assert text.count("amazonaws.com" + PATH) >= 3, text  # the request, the warning, the trace


def test_a_url_keeps_no_user_password_or_query_in_a_log_line() -> None:
    line = "failed: 'https://user:pw@h.example:9000/a/b?token=s3cr3t#frag' and http://x/y"
    assert logs.scrub(line) == "failed: 'https://h.example:9000/a/b?…' and http://x/y"
