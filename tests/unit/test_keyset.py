"""The key set's decisions: when a key has outlived its tasks, totals, pages of keys."""

from __future__ import annotations

import pytest

from coalescer import keyset
from coalescer.errors import InvalidInput


def test_a_key_outlives_its_tasks_at_the_newest_deadline_plus_grace() -> None:
    assert keyset.outlived(None, now_ms=0, grace_ms=10)
    assert not keyset.outlived(100, now_ms=109, grace_ms=10)
    assert keyset.outlived(100, now_ms=110, grace_ms=10)
    assert keyset.expires_ms(100, 10) == 110


def test_a_tally_counts_keys_with_pending_tasks_and_the_oldest_wait() -> None:
    tally = keyset.Tally()
    tally.add(0, None)
    tally.add(2, 500)
    tally.add(3, 300)
    tally.add(1, None)
    assert (tally.with_pending, tally.pending, tally.oldest_since_ms) == (3, 6, 300)


def test_totals_say_how_old_they_are() -> None:
    t = keyset.Totals(keys=5, counted_ms=1000, with_pending=1, pending=2, oldest_since_ms=500)
    assert t.age_seconds(4000) == 3.0
    assert t.oldest_wait_seconds(4000) == 3.5
    assert keyset.Totals(keys=5).age_seconds(4000) == 0.0
    assert keyset.Totals(keys=5, counted_ms=9000).age_seconds(4000) == 0.0


def test_pages_of_keys() -> None:
    assert keyset.page_number(None) == keyset.page_number("") == 1
    assert keyset.page_number("3") == 3
    assert keyset.page_range(1) == (0, keyset.PAGE_SIZE - 1)
    assert keyset.page_range(3, 10) == (20, 29)
    assert keyset.cursor(None) == 0 and keyset.cursor("1234") == 1234


@pytest.mark.parametrize("raw", ["0", "-1", "x", "1.5", "²", "9999999999"])
def test_a_bad_page_number_is_a_clear_error(raw: str) -> None:
    with pytest.raises(InvalidInput, match="'page' must be a whole number"):
        keyset.page_number(raw)


@pytest.mark.parametrize("raw", ["-1", "abc", "1" * 20])
def test_a_bad_cursor_is_a_clear_error(raw: str) -> None:
    with pytest.raises(InvalidInput, match="'after' must be the cursor"):
        keyset.cursor(raw)
