"""The emulator's copy of the queue database's ICU collation, for taskIds."""

from __future__ import annotations

from coalescer.emulator.collation import sort_key


def test_letters_compare_without_case_first_then_lowercase_first() -> None:
    words = ["b", "A", "a", "B", "ab", "Ab", "aB", "aa"]
    assert sorted(words, key=sort_key) == ["a", "A", "aa", "ab", "aB", "Ab", "b", "B"]


def test_underscore_then_hyphen_then_digits_then_letters() -> None:
    assert sorted(["a", "9", "-", "_", "0", "Z"], key=sort_key) == ["_", "-", "0", "9", "a", "Z"]


def test_a_prefix_sorts_first() -> None:
    assert sorted(["abc", "ab", "Ab"], key=sort_key) == ["ab", "Ab", "abc"]
