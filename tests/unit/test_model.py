from __future__ import annotations

import pytest

from coalescer import model
from coalescer.errors import InvalidInput
from coalescer.model import KeySnapshot, supersedes


def test_keys_come_from_prefixed_routes_in_either_form() -> None:
    routes = [
        "route.coalesce.v1.a.b",
        "coalesce.v1.c",
        "index.foo",
        "coalesce.v10.x",
        "coalesce.v1.a.b",
    ]
    assert model.keys_from_routes(routes, "coalesce.v1") == ("a.b", "c")


def test_keys_skip_routes_with_characters_a_key_cannot_have() -> None:
    routes = ["coalesce.v1.a{b}", "coalesce.v1.", "coalesce.v1.a\n", "route.coalesce.v1.b\n"]
    assert model.keys_from_routes(routes, "coalesce.v1") == ()


@pytest.mark.timeout(10)
def test_keys_from_many_distinct_routes_take_linear_time() -> None:
    # 100,000 distinct keys: a quadratic de-duplication takes minutes, a linear one a moment.
    routes = [f"route.coalesce.v1.k{i}" for i in range(100_000)]
    keys = model.keys_from_routes(routes + routes, "coalesce.v1")
    assert keys == tuple(f"k{i}" for i in range(100_000))


def test_keys_are_the_same_from_a_list_or_a_tuple_asked_again_with_another_prefix() -> None:
    routes = ("route.coalesce.v1.a", "coalesce.v2.b")
    assert model.keys_from_routes(routes, "coalesce.v1") == ("a",)
    assert model.keys_from_routes(list(routes), "coalesce.v1") == ("a",)
    assert model.keys_from_routes(routes, "coalesce.v2") == ("b",)  # remembered per prefix


@pytest.mark.parametrize(
    "value", ["2030-01-01T00:00:00", "2030-13-01T00:00:00Z", "", 5, None, {"a": 1}, ["x"]]
)
def test_a_date_time_that_is_not_one_is_invalid_input_every_time(value: object) -> None:
    for _ in range(2):  # a refusal is never remembered as an answer
        with pytest.raises(InvalidInput):
            model.parse_time_ms(value)  # type: ignore[arg-type]


def test_date_times_read_again_are_the_same_instant() -> None:
    first = model.parse_time_ms("2030-01-01T00:00:00.250Z")
    assert first == model.parse_time_ms("2030-01-01T00:00:00.250Z") == 1893456000250
    assert model.parse_time_ms("2030-01-01T01:00:00.250+01:00") == first


@pytest.mark.parametrize(
    "path,key", [("build/linux/master", "build.linux.master"), ("a.b/c", "a.b.c"), ("/x/", "x")]
)
def test_a_url_path_names_a_dotted_key(path: str, key: str) -> None:
    assert model.key_from_path(path) == key


@pytest.mark.parametrize(
    "bad", ["", "a..b", "a b", "a/<script>", "x" * 201, "a.{b}", "a\n", "a.b\n"]
)
def test_malformed_keys_are_refused_with_a_reason(bad: str) -> None:
    with pytest.raises(InvalidInput):
        model.check_key(bad)


@pytest.mark.parametrize(
    "bad", ["abc", "fN1SbArXTPSVFNUvaOlinQ!", "fN1SbArXTPSVFNUvaOlin", "fN1SbArXTPSVFNUvaOlinQ\n"]
)
def test_malformed_task_ids_are_refused(bad: str) -> None:
    with pytest.raises(InvalidInput, match="malformed taskId"):
        model.check_task_id(bad)


def test_time_parsing_needs_a_zone() -> None:
    assert model.parse_time_ms("2030-01-01T00:00:00.000Z") == 1893456000000
    with pytest.raises(InvalidInput):
        model.parse_time_ms("2030-01-01T00:00:00")
    with pytest.raises(InvalidInput):
        model.parse_time_ms("yesterday")


def snap(newest: list[str], newer: int | None, oldest: int | None = 0) -> KeySnapshot:
    return KeySnapshot(pending=len(newest), oldest_since_ms=oldest, newest=newest, newer=newer)


def test_answer_is_oldest_first_with_the_initial_task_in_its_place() -> None:
    assert supersedes("B", snap(["D", "C", "A"], newer=2), now_ms=10) == (
        ["A", "B", "C", "D"],
        "ok",
    )
    assert supersedes("E", snap(["D", "C"], newer=0), now_ms=10)[0] == ["C", "D", "E"]
    assert supersedes("Z", snap(["D", "C"], newer=2), now_ms=10)[0] == ["Z", "C", "D"]


def test_unknown_initial_task_is_answered_alone() -> None:
    assert supersedes("B", snap(["D", "C"], newer=None), now_ms=10) == (["B"], "unknown")


def test_cap_keeps_the_newest_and_the_initial_task() -> None:
    newest = [f"t{i:02d}" for i in range(40, 0, -1)]
    answer, _ = supersedes("t01", snap(newest, newer=39), now_ms=0, cap=4)
    assert answer == ["t01", "t38", "t39", "t40"]


def test_initial_task_already_pending_is_listed_once() -> None:
    assert supersedes("A", snap(["B", "A"], newer=1), now_ms=0)[0] == ["A", "B"]


@pytest.mark.parametrize(
    "pending,wait_s,age,size,passes",
    [
        (3, 100, None, 2, True),
        (3, 100, None, 3, False),  # size must be exceeded, not met
        (3, 100, 99, None, True),
        (3, 100, 100, None, False),  # age must be exceeded, not met
        (0, 100, None, None, False),
    ],
)
def test_thresholds_are_strictly_exceeded(
    pending: int, wait_s: int, age: int | None, size: int | None, passes: bool
) -> None:
    assert model.passes_thresholds(pending, wait_s, age, size) is passes


def test_threshold_unmet_answers_the_initial_task_alone() -> None:
    s = KeySnapshot(pending=2, oldest_since_ms=0, newest=["B", "A"], newer=1)
    assert supersedes("A", s, now_ms=1000, size=2) == (["A"], "threshold")
    assert supersedes("A", s, now_ms=1000, age=5) == (["A"], "threshold")
    assert supersedes("A", s, now_ms=10_000, age=5, size=1) == (["A", "B"], "ok")


def test_compat_list_is_newest_first_or_empty() -> None:
    s = KeySnapshot(pending=3, oldest_since_ms=0, newest=["C", "B", "A"])
    assert model.compat_list(s, now_ms=10_000, age=5, size=2) == ["C", "B", "A"]
    assert model.compat_list(s, now_ms=10_000, age=5, size=3) == []
    assert model.compat_list(s, now_ms=10_000, age=10, size=0) == []


def test_docker_worker_list_is_the_answer_newest_first() -> None:
    s = snap(["D", "C", "A"], newer=2)
    assert model.docker_worker_list("B", s, now_ms=10) == (["D", "C", "B", "A"], "ok")
    assert model.docker_worker_list("B", s, now_ms=10, size=3) == (["B"], "threshold")
    assert model.docker_worker_list("B", snap(["D"], newer=None), now_ms=10) == (["B"], "unknown")


def test_docker_worker_list_answers_a_resolved_initial_task_alone() -> None:
    s = KeySnapshot(pending=2, oldest_since_ms=0, newest=["D", "C"], newer=2, initial_resolved=True)
    assert model.docker_worker_list("B", s, now_ms=10) == (["B"], "resolved")
