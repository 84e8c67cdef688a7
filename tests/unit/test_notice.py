"""What a superseded run's log says: the task that superseded it, the order, the links, why."""

from __future__ import annotations

import pytest

from coalescer.worker.notice import Why, listed_order, ordinal, render, service_base, shown_url

A, B, C = "E5SBRfo-RfOIxh0V4187Qg", "AbN5WN6USOqdbhAyPHRD2w", "KGt8egfvRaqxczIRgOScaw"


@pytest.mark.parametrize(
    ("n", "text"), [(1, "1st"), (2, "2nd"), (3, "3rd"), (4, "4th"), (11, "11th"), (22, "22nd")]
)
def test_ordinals(n: int, text: str) -> None:
    assert ordinal(n) == text


def test_the_order_names_both_places_in_the_list() -> None:
    assert listed_order([A, B, C], A, C) == (
        f"1st of 3 tasks listed oldest first; {C} is 3rd, the newest this worker could claim"
    )
    assert listed_order([A, C], B, C) is None


@pytest.mark.parametrize(
    ("url", "base"),
    [
        ("http://svc:8000/build/linux", "http://svc:8000"),
        ("http://svc:8000/build.linux?age=60", "http://svc:8000"),
        ("https://svc.example/mount/build/linux/", "https://svc.example/mount"),
        ("http://svc/v1/docker-worker/build.linux", "http://svc"),
        ("http://svc/v1/list/60/5/build.linux", "http://svc"),
        ("http://svc/other/key", None),
        ("http://user:pw@svc/build/linux?x=<b>", "http://svc"),
        ("http://svc/(x)[y]<z>/build/linux", "http://svc/%28x%29%5By%5D%3Cz%3E"),
    ],
)
def test_the_service_base_comes_from_a_superseder_url_naming_the_key(
    url: str, base: str | None
) -> None:
    assert service_base(url, ["coalesce.v1.build.linux", "index.x"], "coalesce.v1") == base


def test_a_canceled_run_says_who_superseded_it_and_never_that_it_passed() -> None:
    text = render(
        A,
        0,
        (C, 1),
        "canceled",
        "the queue rejects reason 'superseded'",
        Why("the superseder answered 3 tasks", listed_order([A, B, C], A, C), "http://svc"),
        root_url="https://tc.example/",
        by="worker g/w",
    ).decode()
    lines = text.splitlines()
    assert all(line.startswith("[coalescer] ") for line in lines)
    assert f"task {C} run 1 superseded it" in text
    assert "Resolved exception/canceled: the queue rejects reason 'superseded'." in text
    assert "Why: the superseder answered 3 tasks" in text
    assert f"Order: this task is 1st of 3 tasks listed oldest first; {C} is 3rd" in text
    assert f"Superseding task: https://tc.example/tasks/{C}" in text
    assert f"This task on the superseder: http://svc/tasks/{A}" in text
    assert lines[-1] == "[coalescer] Resolved by worker g/w."


def test_a_released_run_says_it_runs_again_and_names_no_link_it_lacks() -> None:
    text = render(
        A, 2, (C, 0), "released", "no cancel scope", Why("rule"), root_url=None, by="x"
    ).decode()
    assert "given back to the queue and the task will run again (no cancel scope)" in text
    assert f"would have been superseded by task {C} run 0" in text
    assert "superseded it" not in text
    assert "Superseding task:" not in text and "on the superseder:" not in text


HOSTILE = "[Download-fix](https://evil.example/fix.sh)<img/src=x/onerror=alert(1)>"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (
            f"http://svc:8000/k?age=60&size=5&taskId={A}",
            f"http://svc:8000/k?age=60&size=5&taskId={A}",
        ),
        (f"http://svc/k?x={HOSTILE}&taskId={A}", f"http://svc/k?taskId={A}"),
        (f"http://svc/k?age={HOSTILE}", "http://svc/k"),
        ("http://user:pw@svc/k", "http://svc/k"),
        ("https://svc/k/<b>[x](y)", "https://svc/k/%3Cb%3E%5Bx%5D%28y%29"),
        ("http://ev<il>/k", "http://invalid-host/k"),
        ("http://[::1]:8000/k#frag", "http://[::1]:8000/k"),
        ("http://svc/a~b/c+d/e:f@g", "http://svc/a~b/c+d/e:f@g"),
        ("http://coalescer_web:8000/k", "http://coalescer_web:8000/k"),
    ],
)
def test_a_url_shown_in_a_log_keeps_no_markup_credentials_or_foreign_query(
    url: str, shown: str
) -> None:
    assert shown_url(url) == shown
