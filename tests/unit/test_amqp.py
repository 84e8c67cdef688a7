"""How ``listen`` reads ``PULSE_URL`` for its AMQP connection: as aio-pika reads it at start;
and how a session ends when its connection dies."""

from __future__ import annotations

import asyncio
import logging
import ssl

import pika
import pytest

from coalescer.ingest import amqp
from coalescer.ingest.amqp import DEFAULT_HEARTBEAT, Session, Unavailable, heartbeat, parameters


def test_an_amqp_url_gives_host_port_vhost_credentials_and_the_connection_name() -> None:
    p = parameters("amqp://us%40er:p%2Fss@broker.example:5673/my%2Fvhost", "coalescer pid 1")
    assert (p.host, p.port, p.virtual_host) == ("broker.example", 5673, "my/vhost")
    assert isinstance(p.credentials, pika.PlainCredentials)
    assert (p.credentials.username, p.credentials.password) == ("us@er", "p/ss")
    assert p.client_properties["connection_name"] == "coalescer pid 1"
    assert p.ssl_options is None


def test_defaults_are_the_brokers_usual_ones() -> None:
    p = parameters("amqp://localhost", "n")
    assert (p.port, p.virtual_host) == (5672, "/")
    assert (p.credentials.username, p.credentials.password) == ("guest", "guest")
    assert parameters("amqp://localhost/", "n").virtual_host == "/"


def test_amqps_verifies_the_certificate_against_the_hostname() -> None:
    p = parameters("amqps://u:p@pulse.example/vhost?heartbeat=30", "n")
    assert p.port == 5671 and p.heartbeat == 30
    assert p.ssl_options is not None
    assert p.ssl_options.server_hostname == "pulse.example"
    context = p.ssl_options.context
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname


def test_the_heartbeat_finds_a_dead_connection_within_a_minute_unless_the_url_names_one() -> None:
    assert heartbeat("amqp://localhost/") == DEFAULT_HEARTBEAT
    assert parameters("amqp://localhost/", "n").heartbeat == DEFAULT_HEARTBEAT
    # pika closes a silent connection within two checks, heartbeat + 5 s apart; RabbitMQ
    # within three heartbeats, and only then gives back what it had delivered on it.
    assert 2 * (DEFAULT_HEARTBEAT + 5) < 60 and 3 * DEFAULT_HEARTBEAT < 60
    assert parameters("amqp://localhost/?heartbeat=5", "n").heartbeat == 5
    assert heartbeat("amqps://u:p@h/v?cafile=/ca.pem&heartbeat=0") == 0  # 0: no heartbeat


class _DeadSocket:
    """A pika connection whose socket is gone without pika knowing: every write raises (as
    uvloop does once it stopped watching the socket)."""

    is_closing = is_closed = False

    def close(self) -> None:
        raise RuntimeError("unable to perform operation on <UVPoll closed=True>; closed")


def _ack() -> None:
    raise RuntimeError("unable to perform operation on <UVPoll closed=True>; closed")


async def test_a_write_that_fails_with_any_error_ends_the_session_at_once() -> None:
    session = Session(_DeadSocket(), asyncio.get_running_loop())  # type: ignore[arg-type]
    with pytest.raises(Unavailable, match="RuntimeError: unable to perform"):
        session.send(_ack)
    assert session.closed.done() and isinstance(session.closed.result(), RuntimeError)
    # No goodbye to wait for on a dead socket: closing returns at once.
    await asyncio.wait_for(session.wait_closed(), 0.5)


def test_a_heartbeat_on_a_connection_already_gone_is_a_warning_and_the_rest_is_not_hidden(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Handle:
        def __repr__(self) -> str:
            return "<TimerHandle HeartbeatChecker._send_heartbeat>"

    loop = asyncio.new_event_loop()
    try:
        gone = RuntimeError("unable to perform operation on <UVPoll closed=True>")
        with caplog.at_level(logging.WARNING):
            amqp.on_loop_error(loop, {"exception": gone, "handle": Handle()})
            amqp.on_loop_error(loop, {"exception": ValueError("a bug"), "message": "boom"})
        said = [(r.levelno, r.getMessage()) for r in caplog.records]
        assert said[0][0] == logging.WARNING and "heartbeat could not be sent" in said[0][1]
        assert said[1][0] == logging.ERROR and "boom" in said[1][1]  # the default handler's
    finally:
        loop.close()
