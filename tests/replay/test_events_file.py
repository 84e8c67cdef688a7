"""``replay --events`` reads the repository's example, a JSON array of messages (the body of
``POST /v1/events``), as it reads JSON lines; what it cannot read, it says in one line with the
format it expects."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from coalescer.replay.sources import SourceError, read_events

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "events.json"


def test_the_example_events_file_is_read_as_an_array_of_messages() -> None:
    with EXAMPLE.open("rb") as lines:
        read = list(read_events(lines))
    sent = orjson.loads(EXAMPLE.read_bytes())
    assert [m.payload["status"]["taskId"] for m in read] == [
        m["payload"]["status"]["taskId"] for m in sent
    ]
    assert list(read[0].routes) == ["route.coalesce.v1.mozilla-central.linux-tests"]
    # The same messages as JSON lines read alike.
    as_lines = [orjson.dumps(m) + b"\n" for m in sent]
    assert [m.payload for m in read_events(as_lines)] == [m.payload for m in read]


@pytest.mark.parametrize(
    ("lines", "says"),
    [
        ([b"\n", b'{"exchange": \n'], "line 2: "),
        ([b"[\n", b'{"exchange": "x"}\n'], "line 1: "),
        ([b'[{"exchange": 3}]\n'], "message 1 of the array: "),
    ],
)
def test_what_cannot_be_read_is_said_with_the_format_expected(
    lines: list[bytes], says: str
) -> None:
    with pytest.raises(SourceError, match=says) as caught:
        list(read_events(lines))
    message = str(caught.value)
    assert "\n" not in message
    if not says.startswith("message"):
        assert "JSON lines" in message and "JSON array of messages" in message
