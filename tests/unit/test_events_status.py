"""A task status → index event (the version logic shared by Pulse messages and reconcile), and
the names the Pulse consumer declares and binds."""

from __future__ import annotations

from typing import Any

import pytest

from coalescer.errors import InvalidEvent
from coalescer.ingest.events import (
    EXCHANGE_PREFIX,
    EXCHANGE_STATES,
    Message,
    status_event,
    to_event,
)
from coalescer.ingest.topology import bindings, dead_letter_names, default_queue, queue_arguments
from coalescer.model import TERMINAL_RUN, parse_time_ms
from tests.conftest import make_message

TASK = "fN1SbArXTPSVFNUvaOlinQ"
KEYS = ("k",)


def status_of(message: dict[str, Any]) -> dict[str, Any]:
    status: dict[str, Any] = message["payload"]["status"]
    return status


@pytest.mark.parametrize(
    ("state", "run_id"),
    [
        ("pending", 0),
        ("running", 0),
        ("completed", 0),
        ("failed", 1),
        ("exception", 2),
        ("pending", 3),
    ],
)
def test_a_status_gives_the_same_event_as_the_message_that_carried_it(
    state: str, run_id: int
) -> None:
    message = make_message(TASK, state, run_id=run_id)
    from_message = to_event(Message.from_json(message), prefix="coalesce.v1")
    assert from_message is not None
    assert status_event(status_of(message), KEYS) == from_message
    assert (from_message.run_id, from_message.state) == (run_id, state)


def test_the_newest_run_of_a_status_is_its_version() -> None:
    # Run 0 resolved with worker-shutdown, run 1 pending: a retried task is pending again.
    event = status_event(status_of(make_message(TASK, "pending", run_id=1)), KEYS)
    assert event is not None
    assert (event.run_id, event.state, event.version) == (1, "pending", (1, 1))


def test_a_message_announcing_an_older_run_than_its_status_takes_the_status() -> None:
    status = status_of(make_message(TASK, "running", run_id=0))
    event = status_event(status, KEYS, announced=(0, "pending"))
    assert event is not None and event.state == "running"


def test_a_task_resolved_before_any_run_is_final() -> None:
    status = status_of(make_message(TASK, "exception", run_id=None))
    event = status_event(status, KEYS)
    assert event is not None
    assert (event.run_id, event.state, event.reason) == (
        TERMINAL_RUN,
        "exception",
        "deadline-exceeded",
    )
    assert event.order == parse_time_ms(status["deadline"])


def test_an_unscheduled_task_without_runs_gives_no_event() -> None:
    status = status_of(make_message(TASK, "pending", run_id=None))
    status["state"] = "unscheduled"
    assert status_event(status, KEYS) is None


def test_an_order_given_overrides_the_status() -> None:
    event = status_event(status_of(make_message(TASK)), KEYS, order=42.0)
    assert event is not None and event.order == 42.0


def test_the_rank_tag_orders_by_task_tag_and_must_be_a_number() -> None:
    message = make_message(TASK, tags={"push": "17"})
    event = to_event(Message.from_json(message), prefix="coalesce.v1", rank_tag="push")
    assert event is not None and event.order == 17.0
    with pytest.raises(InvalidEvent, match="push"):
        status_event(status_of(message), KEYS, tags={"push": "x"}, rank_tag="push")


def test_a_malformed_deadline_is_an_invalid_event() -> None:
    status = status_of(make_message(TASK))
    status["deadline"] = "tomorrow"
    with pytest.raises(InvalidEvent, match="RFC 3339"):
        status_event(status, KEYS)


def test_bindings_come_from_the_official_client_for_every_state_exchange() -> None:
    found = bindings("coalesce.v1")
    assert [e for e, _ in found] == [EXCHANGE_PREFIX + name for name in EXCHANGE_STATES]
    assert {p for _, p in found} == {"route.coalesce.v1.#"}


def test_queue_names_follow_pulses_naming_rule() -> None:
    assert default_queue("amqps://my%2Duser:pw@pulse.example.com:5671/vhost") == (
        "queue/my-user/coalescer"
    )
    assert dead_letter_names("queue/u/coalescer") == (
        "exchange/u/coalescer/dead",
        "queue/u/coalescer/dead",
    )
    assert dead_letter_names("plain") == ("plain/dead", "plain/dead")


def test_the_queue_is_bounded_and_refuses_rather_than_drops() -> None:
    args = queue_arguments("queue/u/c", 500)
    assert args == {
        "x-max-length": 500,
        "x-overflow": "reject-publish",
        "x-dead-letter-exchange": "exchange/u/c/dead",
    }


def test_a_message_with_more_routes_than_a_task_can_have_is_invalid() -> None:
    # task.json caps task.routes at 64; the queue CCs each one as route.<route>.
    many = tuple(f"coalesce.v1.k{i}" for i in range(64))
    event = to_event(Message.from_json(make_message(TASK, routes=many)), prefix="coalesce.v1")
    assert event is not None and len(event.keys) == 64
    flood = Message.from_json(make_message(TASK, routes=(*many, "coalesce.v1.one-more")))
    with pytest.raises(InvalidEvent, match="65 routes; a queue message carries at most 64"):
        to_event(flood, prefix="coalesce.v1")


def test_a_task_id_with_a_trailing_newline_is_invalid() -> None:
    # The schema's pattern ends in "$", which Python's re also matches before a final newline.
    message = make_message(TASK)
    message["payload"]["status"]["taskId"] = TASK + "\n"
    with pytest.raises(InvalidEvent, match=r"status/taskId: .* does not match"):
        to_event(Message.from_json(message), prefix="coalesce.v1")
