"""The recorder: Pulse-shaped JSON lines that ``coalescer replay --events`` reads back, a size
bound with one rotation, and failures that are counted instead of raised."""

from __future__ import annotations

from pathlib import Path

from coalescer.ingest.events import Message
from coalescer.ingest.record import FAILURES, Recorder
from coalescer.replay import sources
from tests.conftest import make_message


def messages(n: int, start: int = 0) -> list[Message]:
    return [
        Message.from_json(make_message(f"task{start + i:018d}", routes=("coalesce.v1.k",)))
        for i in range(n)
    ]


def test_lines_read_back_as_the_same_messages(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    recorder = Recorder(str(path))
    sent = messages(5)
    recorder.record(sent[:2])
    recorder.record([])
    recorder.record(sent[2:])
    recorder.close()
    with open(path, "rb") as lines:
        assert list(sources.read_events(lines)) == sent


def test_appends_to_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    for batch in (messages(2), messages(3, start=2)):
        recorder = Recorder(str(path))
        recorder.record(batch)
        recorder.close()
    assert len(path.read_bytes().splitlines()) == 5


def test_rotates_once_at_the_size_limit(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    one = Recorder(str(tmp_path / "one.jsonl"))
    one.record(messages(1))
    one.close()
    line = (tmp_path / "one.jsonl").stat().st_size
    limit = line * 10 + line // 2
    recorder = Recorder(str(path), max_bytes=limit)
    for i in range(100):
        recorder.record(messages(1, start=i))
    recorder.close()
    files = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("events"))
    assert files == ["events.jsonl", "events.jsonl.1"]
    assert path.stat().st_size <= limit and Path(f"{path}.1").stat().st_size <= limit
    # The newest lines survive, in order, across the two files.
    with open(f"{path}.1", "rb") as older, open(path, "rb") as newer:
        kept = [m.payload["status"]["taskId"] for m in sources.read_events([*older, *newer])]
    assert kept == [f"task{i:018d}" for i in range(100 - len(kept), 100)]
    assert len(kept) == 20


def test_a_failed_write_is_counted_not_raised(tmp_path: Path) -> None:
    before = FAILURES._value.get()
    recorder = Recorder(str(tmp_path / "missing" / "events.jsonl"))
    recorder.record(messages(3))
    recorder.close()
    assert FAILURES._value.get() == before + 3
