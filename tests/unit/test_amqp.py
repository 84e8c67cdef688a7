"""How ``listen`` reads ``PULSE_URL`` for its AMQP connection: as aio-pika reads it at start."""

from __future__ import annotations

import ssl

import pika

from coalescer.ingest.amqp import parameters


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
