"""The history behind the pages' charts: bounded rings of time buckets, counted once."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from coalescer import history
from coalescer.errors import ConfigError
from coalescer.history import Durations, Retention, Sampler, Series, Tally
from coalescer.model import TaskEvent
from coalescer.observe import Observer
from coalescer.store import Store, keys, open_store
from coalescer.store import history as stored

MINUTE = 60_000
NOW = 1_900_000_040_000  # 20 s into a minute
RETENTION = Retention(MINUTE, 10)


@pytest.fixture
async def store() -> AsyncIterator[Store]:
    s = await open_store(None, grace_seconds=3600)  # embedded: fakeredis runs the Lua
    yield s
    await s.close()


def event(
    task_id: str,
    state: str,
    *,
    reason: str = "",
    started: int = 0,
    resolved: int = 0,
    key: str = "k",
) -> TaskEvent:
    return TaskEvent(
        task_id, 0, state, (key,), 1.0, NOW + 3_600_000, NOW, reason, started, resolved
    )


def test_a_bucket_starts_on_its_width_and_has_a_slot_in_the_ring() -> None:
    r = Retention(MINUTE, 10)
    assert r.start(NOW) == NOW - 20_000
    assert r.slot(r.start(NOW)) == r.slot(r.start(NOW) + 10 * MINUTE)
    assert r.oldest(NOW) == r.start(NOW) - 9 * MINUTE
    assert r.per_key() == Retention(5 * MINUTE, 2)
    with pytest.raises(ConfigError):
        Retention(500, 10)
    with pytest.raises(ConfigError):
        Retention(MINUTE, 1)


def test_a_tally_hands_its_counts_over_once_and_takes_back_a_failed_write() -> None:
    tally = Tally(RETENTION)
    tally.add(history.ANSWERS, NOW)
    tally.add(history.ANSWERS, NOW + 1000)
    tally.add(history.ANSWERS, NOW + MINUTE)
    taken = tally.take()
    start = RETENTION.start(NOW)
    assert taken == {(history.ANSWERS, start): 2, (history.ANSWERS, start + MINUTE): 1}
    assert not tally and tally.take() == {}
    tally.restore(taken)
    tally.add(history.ANSWERS, NOW)
    assert tally.take()[(history.ANSWERS, start)] == 3


def test_durations_are_bounded_per_key_and_in_keys() -> None:
    d = Durations()
    assert d.estimate(["k"]) is None
    for ms in range(100):
        d.add("k", ms * 1000)
    assert d.estimate(["k"]) == int((80 + 99) / 2 * 1000)  # the newest 20: 80..99 s
    for n in range(Durations.KEYS + 5):
        d.add(f"other{n}", 7)
    assert d.estimate(["k"]) is None  # the least recently seen key went first
    assert d.estimate(["nothing", f"other{Durations.KEYS}"]) == 7


def test_a_sampler_writes_what_changed_or_has_not_been_written_for_a_while() -> None:
    s = Sampler(RETENTION)

    def round_(samples: list[tuple[str, int]], at: int) -> list[tuple[str, int]]:
        due = s.due(samples, at)
        s.wrote(due, at)
        return due

    assert round_([("a", 1), ("b", 0)], NOW) == [("a", 1), ("b", 0)]
    assert round_([("a", 1), ("b", 2)], NOW + MINUTE) == [("b", 2)]
    s.done()
    later = NOW + history.CARRY * MINUTE
    assert round_([("a", 1), ("b", 2)], later) == [("a", 1)]
    s.done()
    s.done()  # a round that saw neither: both forgotten, written again when seen
    assert round_([("a", 1)], later) == [("a", 1)]
    assert s.due([("a", 3)], later) == [("a", 3)]  # its write failed (not reported written):
    assert s.due([("a", 3)], later) == [("a", 3)]  # still due


def test_decoding_fills_every_bucket_and_carries_gauges_forward() -> None:
    start = RETENTION.start(NOW)
    raw = {
        f"answers:{RETENTION.slot(start - 2 * MINUTE)}": f"{start - 2 * MINUTE}|4",
        f"pending:{RETENTION.slot(start - 3 * MINUTE)}": f"{start - 3 * MINUTE}|7",
        f"pending:{RETENTION.slot(start - MINUTE)}": f"{start - MINUTE}|2",
        "answers:junk": "not|a number",
    }
    got = history.decode(raw, RETENTION, now_ms=NOW, since_ms=start - 4 * MINUTE)
    assert [v for _, v in got["answers"].points] == [0, 0, 4, 0, 0]
    assert [v for _, v in got["pending"].points] == [None, 7, 7, 2, 2]
    assert got["pending"].latest == 2 and got["answers"].total == 4
    assert history.first_activity(raw) == start - 3 * MINUTE
    # A gauge is carried forward CARRY buckets at most.
    long = Retention(MINUTE, 100)
    one = {f"pending:{long.slot(start - 50 * MINUTE)}": f"{start - 50 * MINUTE}|3"}
    points = history.decode(one, long, now_ms=NOW)["pending"].points
    assert [v for _, v in points].count(3.0) == history.CARRY
    assert points[-1][1] is None


def test_rebinning_sums_counts_and_keeps_a_gauges_newest_sample() -> None:
    counts = Series("answers", ((0, 1.0), (1, 2.0), (2, 3.0)))
    assert history.rebin(counts, 2).points == ((0, 3.0), (2, 3.0))
    gauge = Series("pending", ((0, 5.0), (1, None), (2, None)))
    assert history.rebin(gauge, 2).points == ((0, 5.0), (2, None))


async def test_the_ring_adds_sets_and_drops_what_is_past_the_retention(store: Store) -> None:
    start = RETENTION.start(NOW)
    await store.count(
        {},
        history={(history.ANSWERS, start): 2, (history.SUPERSEDED, start): 1},
        retention=RETENTION,
    )
    await store.count({}, history={(history.ANSWERS, start): 3}, retention=RETENTION)
    await stored.sample_pending(store, RETENTION, now_ms=NOW, total=5)
    await stored.sample_pending(store, RETENTION, now_ms=NOW + 1000, total=6)  # newest wins
    got = await stored.read(store, RETENTION, now_ms=NOW)
    assert got[history.ANSWERS].points[-1] == (start, 5.0)
    assert got[history.SUPERSEDED].total == 1
    assert got[history.PENDING].latest == 6
    # The bucket a full ring later takes the slot over; the old one, arriving late, is dropped.
    later = start + RETENTION.span_ms
    await store.count({}, history={(history.ANSWERS, later): 1}, retention=RETENTION)
    await store.count({}, history={(history.ANSWERS, start): 9}, retention=RETENTION)
    got = await stored.read(store, RETENTION, now_ms=later)
    assert got[history.ANSWERS].total == 1
    ring = await store.client.hgetall(keys.HISTORY)
    assert len(ring) == 3  # answers, superseded and pending: one slot each, however long it runs
    assert 0 < await store.client.pttl(keys.HISTORY) <= RETENTION.span_ms


async def test_the_ring_never_grows_past_its_buckets(store: Store) -> None:
    for n in range(3 * RETENTION.buckets):
        at = NOW + n * MINUTE
        await store.count(
            {}, history={(history.ANSWERS, RETENTION.start(at)): 1}, retention=RETENTION
        )
        await stored.sample_pending(store, RETENTION, now_ms=at, per_key=[("k", n)], total=n)
    assert await store.client.hlen(keys.HISTORY) == 2 * RETENTION.buckets
    assert await store.client.hlen(keys.history("k")) == RETENTION.per_key().buckets
    end = NOW + (3 * RETENTION.buckets - 1) * MINUTE
    got = await stored.read(store, RETENTION, now_ms=end)
    assert got[history.ANSWERS].total == RETENTION.buckets
    keyed = await stored.read(store, RETENTION, now_ms=end, key="k")
    assert keyed[history.PENDING].latest == 3 * RETENTION.buckets - 1


async def test_a_redelivered_superseded_resolution_counts_once(store: Store) -> None:
    observer = Observer(store, retention=RETENTION)
    done = event("T1", "completed", started=NOW - 90_000, resolved=NOW - 30_000)
    gone = event("T2", "exception", reason="superseded", resolved=NOW)
    for ev in (event("T1", "pending"), event("T2", "pending")):
        assert await store.apply([ev], now_ms=NOW) == ["applied"]
    for batch in ([done, gone], [gone], [done, gone]):  # at least once: delivered again
        outcomes = await store.apply(batch, now_ms=NOW)
        applied = [ev for ev, o in zip(batch, outcomes, strict=True) if o == "applied"]
        await observer.ingest("pulse", outcomes, applied=applied)
    got = await stored.read(store, RETENTION, now_ms=NOW)
    assert got[history.SUPERSEDED].total == 1
    assert got[history.SAVED_MS].total == 60_000  # T1's run, the key's only one seen


async def test_answers_are_counted_by_the_flush_and_kept_when_the_store_fails(
    store: Store,
) -> None:
    observer = Observer(store, retention=RETENTION)
    observer.answer("k", "T1", ["T1"], "alone", NOW)
    observer.answer("k", "T2", ["T1", "T2"], "superseding", NOW + MINUTE)
    await observer.flush()
    await observer.flush()  # nothing new: nothing counted again
    got = await stored.read(store, RETENTION, now_ms=NOW + MINUTE)
    assert [v for _, v in got[history.ANSWERS].points][-2:] == [1.0, 1.0]


def test_the_sampler_remembers_a_bounded_number_of_keys_and_writes_the_rest_each_round() -> None:
    s = Sampler(RETENTION)
    many = [(f"k{i}", 1) for i in range(Sampler.KEYS + 500)]
    for _ in range(2):
        due = s.due(many, 0)
        s.wrote(due, 0)
        s.done()
    assert len(s._written) == Sampler.KEYS and len(s._seen) == 0
    # Remembered keys cost nothing while unchanged; the others are written every round.
    assert s.due(many, 0) == many[Sampler.KEYS :]
