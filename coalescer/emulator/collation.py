"""The order in which the real queue's database lists taskIds: its ICU collation.

The queue's Postgres sorts text with the root ICU collation, not by code point: punctuation
(``_`` before ``-``), then digits, then letters compared without case (``a < A < b < B``), and
only when two ids are otherwise equal does case decide, lowercase first, at the first place they
differ. taskIds are slugs (``[A-Za-z0-9_-]``); any other character sorts after them by code point.
"""

from __future__ import annotations

import string

_PRIMARY = "_-" + string.digits + string.ascii_lowercase
_WEIGHT = {c: i for i, c in enumerate(_PRIMARY)} | {
    c.upper(): i for i, c in enumerate(_PRIMARY) if c.isalpha()
}


def sort_key(text: str) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """A key that sorts strings as the root ICU collation does (see the module docstring)."""
    primary = tuple(_WEIGHT.get(c, len(_PRIMARY) + ord(c)) for c in text)
    return primary, tuple(c.isupper() for c in text)
