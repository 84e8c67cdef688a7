"""The allow-list of superseder URLs: a worker follows a ``supersederUrl`` only under a prefix
its operator named. Pure: no IO.

A URL and the prefixes are compared in one canonical form, so that spelling cannot move a URL
in or out of the list: lower-case scheme and host, no default port, path segments with their
percent-encoding made canonical. What different servers could read differently is refused
instead of guessed: userinfo (``https://allowed@evil``), a fragment, ``.``/``..`` segments
(also percent-encoded, ``%2e%2e``), encoded ``/`` or ``\\``, ``;`` path parameters
(``..;/``), a backslash, empty segments, double encoding (``%25``), control or non-ASCII
characters (a trailing newline, a space), and a host that is not a plain name or address.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from urllib.parse import quote, unquote, urlsplit

#: Printable ASCII without space: nothing else may appear in a URL the worker follows.
_PRINTABLE = re.compile(r"[\x21-\x7e]*")
#: A host name (no trailing dot) or a bracketed IPv6 address, then an optional port.
_NETLOC = re.compile(
    r"(?P<host>[a-z0-9](?:[a-z0-9.-]*[a-z0-9])?|\[[0-9a-f:.]+\])(?::(?P<port>[0-9]{0,5}))?"
)
_DEFAULT_PORTS = {"http": 80, "https": 443}
#: Kept as they are in a canonical path segment (RFC 3986 unreserved and sub-delims but ``;``,
#: plus ``:`` and ``@``); everything else is percent-encoded.
_SEGMENT_SAFE = "-._~!$&'()*+,=:@"


class AmbiguousUrl(ValueError):
    """A URL that servers and proxies could read in more than one way, or not http(s)."""


def canonical_url(url: str) -> str:
    """``url`` in the canonical form the allow-list compares, or :class:`AmbiguousUrl`.

    ``HTTPS://Coalescer.Example.COM:443/a/%6Bey?x=1`` → ``https://coalescer.example.com/a/key?x=1``.
    """
    if not _PRINTABLE.fullmatch(url):
        raise AmbiguousUrl("it has control, space or non-ASCII characters")
    if "\\" in url:
        raise AmbiguousUrl("it has a backslash")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise AmbiguousUrl("it is not an http(s) URL")
    if "#" in url:
        raise AmbiguousUrl("it has a fragment")
    if "@" in parts.netloc:
        raise AmbiguousUrl("it has userinfo (user@host)")
    found = _NETLOC.fullmatch(parts.netloc.lower())
    if found is None:
        raise AmbiguousUrl("its host is not a plain host name or address")
    netloc, port = found["host"], found["port"]
    if port and not 0 < int(port) < 65536:
        raise AmbiguousUrl("its port is not a number from 1 to 65535")
    if port and int(port) != _DEFAULT_PORTS[scheme]:
        netloc += f":{int(port)}"
    segments = parts.path.split("/")[1:]
    # A trailing slash leaves one empty last segment: it is part of the path as written.
    last = [""] if segments and segments[-1] == "" else []
    path = "/".join([_segment(s) for s in segments[: len(segments) - len(last)]] + last)
    query = f"?{parts.query}" if "?" in url else ""
    return f"{scheme}://{netloc}/{path}{query}"


def _segment(raw: str) -> str:
    if ";" in raw:
        raise AmbiguousUrl("it has a ';' path parameter")
    try:
        decoded = unquote(raw, errors="strict")
    except UnicodeDecodeError:
        raise AmbiguousUrl("it has percent-encoded bytes that are not UTF-8") from None
    if "%" in decoded or "/" in decoded or "\\" in decoded or ";" in decoded:
        raise AmbiguousUrl("it has a percent-encoded '%', '/', '\\' or ';'")
    if not _PRINTABLE.fullmatch(decoded):
        raise AmbiguousUrl("it has percent-encoded control, space or non-ASCII characters")
    if decoded in ("", ".", ".."):
        raise AmbiguousUrl("it has an empty, '.' or '..' path segment")
    return quote(decoded, safe=_SEGMENT_SAFE)


def url_allowed(url: str, prefixes: Sequence[str]) -> bool:
    """True when ``url`` is an unambiguous http(s) URL under one of ``prefixes``.

    Both are compared in canonical form (:func:`canonical_url`), and a prefix matches at a
    boundary only: ``https://h/a`` allows ``https://h/a/k`` but not ``https://h/ab``.
    """
    try:
        canonical = canonical_url(url)
    except AmbiguousUrl:
        return False
    for prefix in prefixes:
        try:
            head = canonical_url(prefix)
        except AmbiguousUrl:
            continue
        if not prefix.endswith("/") and head.endswith("/") and "?" not in head:
            head = head[:-1]  # "https://h/a" names the path "/a", not "/a/"
        if not canonical.startswith(head):
            continue
        rest = canonical[len(head) :]
        if head.endswith(("/", "?", "&")) or not rest or rest[0] in "/?":
            return True
    return False
