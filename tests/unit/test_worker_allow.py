"""The worker's allow-list of superseder URLs: compared in canonical form, ambiguity refused."""

from __future__ import annotations

import pytest

from coalescer.worker.allow import AmbiguousUrl, canonical_url, url_allowed

PREFIXES = ["https://coalescer.example.com", "https://tc.example.com/coalesce/"]


@pytest.mark.parametrize(
    ("url", "allowed"),
    [
        ("https://coalescer.example.com/build/linux", True),
        ("https://coalescer.example.com", True),
        ("https://coalescer.example.com/", True),
        ("https://coalescer.example.com?x=1", True),
        ("https://coalescer.example.com.evil.org/build", False),
        ("https://coalescer.example.com@evil.org/build", False),
        ("https://coalescer.example.comx/build", False),
        ("http://coalescer.example.com/build", False),
        ("https://other.example.com/build", False),
        ("ftp://coalescer.example.com/build", False),
        ("https://tc.example.com/coalesce/key", True),
        ("https://tc.example.com/coalescer-evil/key", False),
        ("https://tc.example.com/other", False),
        # Spelling that names the same resource is allowed...
        ("HTTPS://Coalescer.Example.COM/build", True),
        ("https://coalescer.example.com:443/build", True),
        ("https://TC.example.com:443/%63oalesce/key", True),
        # ... and what a server or proxy could read differently is refused.
        ("https://coalescer.example.com/build\n", False),
        ("https://coalescer.example.com/build%0a", False),
        ("https://coalescer.example.com/a b", False),
        ("https://coalescer.example.com/build/../admin", False),
        ("https://coalescer.example.com/%2E%2E/admin", False),
        ("https://tc.example.com/coalesce/..%2fadmin", False),
        ("https://tc.example.com/coalesce/%2e%2e%2fadmin", False),
        ("https://tc.example.com/coalesce/%2e%2e/admin", False),
        ("https://tc.example.com/coalesce/..;/admin", False),
        ("https://tc.example.com/coalesce/key;jsessionid=1", False),
        ("https://tc.example.com/coalesce/%252e%252e/admin", False),
        ("https://tc.example.com/coalesce\\..\\admin", False),
        ("https://tc.example.com/coalesce//admin", False),
        ("https://tc.example.com/coalesce/key#frag", False),
        ("https://tc.example.com/coalesce/%ff", False),
        ("https://user:pw@tc.example.com/coalesce/key", False),
        ("https://tc.example.com./coalesce/key", False),
        ("https://tc.example.com:8443/coalesce/key", False),
        ("https://tc.example.com:99999/coalesce/key", False),
        ("https://tc%2eexample.com/coalesce/key", False),
        ("https://tc.example.com/coalesce/k\u00e9y", False),
    ],
)
def test_url_must_be_under_an_allowed_prefix_at_a_boundary(url: str, allowed: bool) -> None:
    assert url_allowed(url, PREFIXES) is allowed


def test_nothing_is_allowed_without_prefixes() -> None:
    assert not url_allowed("https://coalescer.example.com/k", [])
    assert not url_allowed("https://coalescer.example.com/k", [""])


def test_an_ambiguous_prefix_allows_nothing() -> None:
    assert not url_allowed("https://h.example.com/a/k", ["https://h.example.com/a/../a/"])


def test_prefixes_with_a_port_or_a_query_match_their_own_form() -> None:
    assert url_allowed("http://127.0.0.1:8000/k", ["http://127.0.0.1:8000/"])
    assert not url_allowed("http://127.0.0.1:8001/k", ["http://127.0.0.1:8000/"])
    assert url_allowed("http://[::1]:8000/k", ["http://[::1]:8000"])
    assert url_allowed("https://h.example.com/k?size=2&age=5", ["https://h.example.com/k?size=2&"])


def test_canonical_form_is_what_the_worker_fetches() -> None:
    assert (
        canonical_url("HTTPS://Coalescer.Example.COM:443/a/%6Bey/?x=%2F")
        == "https://coalescer.example.com/a/key/?x=%2F"
    )
    assert canonical_url("http://h.example.com:80") == "http://h.example.com/"
    assert canonical_url("http://h.example.com:8080/a%3Ab") == "http://h.example.com:8080/a:b"
    with pytest.raises(AmbiguousUrl, match="userinfo"):
        canonical_url("https://a@h.example.com/")
