"""The compiled schema check never accepts a message that jsonschema, the reference, refuses."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from coalescer import schemas
from coalescer.ingest import validation
from tests.conftest import make_message

STATES = ("pending", "running", "completed", "failed", "exception")
ODD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 2000),
    st.text(max_size=30),
    st.sampled_from(["2030-01-01T00:00:00.000Z", "not a date", "fN1SbArXTPSVFNUvaOlinQ", ""]),
    st.lists(st.integers(), max_size=2),
    st.just({}),
)


def paths(node: Any, here: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [here]
    if isinstance(node, dict):
        for key, value in node.items():
            found += paths(value, (*here, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += paths(value, (*here, i))
    return found


@st.composite
def mutated(draw: st.DrawFn) -> tuple[str, Any]:
    state = draw(st.sampled_from(STATES))
    run_id = draw(st.sampled_from([0, 1, None] if state == "exception" else [0, 1]))
    payload = copy.deepcopy(make_message("fN1SbArXTPSVFNUvaOlinQ", state, run_id=run_id)["payload"])
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(paths(payload)[1:]))
        parent = payload
        for step in path[:-1]:
            parent = parent[step]
        action = draw(st.sampled_from(["delete", "replace", "add"]))
        if action == "delete" and isinstance(parent, dict):
            del parent[path[-1]]
        elif action == "add" and isinstance(parent, dict):
            parent[draw(st.sampled_from(["extra", "runId", "state", "reasonResolved"]))] = draw(
                ODD_VALUES
            )
        else:
            parent[path[-1]] = draw(ODD_VALUES)
        if not paths(payload)[1:]:
            break
    return f"task-{state}-message", payload


@settings(max_examples=400, deadline=None)
@given(mutated())
def test_the_fast_check_agrees_with_jsonschema(case: tuple[str, Any]) -> None:
    name, payload = case
    assert validation.errors(name, payload) == schemas.errors(name, payload)


def test_valid_messages_pass_the_fast_check_itself() -> None:
    for state in STATES:
        name = f"task-{state}-message"
        check = validation._compiled(name)
        assert check is not None
        assert check(make_message("fN1SbArXTPSVFNUvaOlinQ", state)["payload"])


def test_patterns_match_whole_values_as_the_queue_reads_them() -> None:
    # ECMA 262's "$" ends the string; Python's would also match before a final newline.
    payload = copy.deepcopy(make_message("fN1SbArXTPSVFNUvaOlinQ", "pending")["payload"])
    payload["status"]["taskId"] += "\n"
    payload["status"]["workerType"] = "linux\n"
    found = schemas.errors("task-pending-message", payload)
    assert len(found) == 2 and all("does not match" in e for e in found), found
    assert validation.errors("task-pending-message", payload) == found
    assert (
        schemas.errors("task-pending-message", make_message("fN1SbArXTPSVFNUvaOlinQ")["payload"])
        == []
    )


def test_repeated_or_odd_runs_are_refused_as_the_reference_refuses_them() -> None:
    payload = copy.deepcopy(make_message("fN1SbArXTPSVFNUvaOlinQ", "pending", run_id=1)["payload"])
    assert validation.errors("task-pending-message", payload) == []
    twice = copy.deepcopy(payload)
    twice["status"]["runs"][1] = copy.deepcopy(twice["status"]["runs"][0])  # the same run, twice
    found = schemas.errors("task-pending-message", twice)
    assert any("non-unique" in e for e in found), found
    assert validation.errors("task-pending-message", twice) == found
    flagged = copy.deepcopy(payload)
    flagged["status"]["runs"][1]["runId"] = True  # not an integer: JSON tells it from 1
    assert validation.errors("task-pending-message", flagged) == schemas.errors(
        "task-pending-message", flagged
    )
