"""What the Pulse consumer declares and binds, and declaring it once before consuming.

Names and routing-key patterns come from the official client's ``QueueEvents``; ours follow
Pulse's rule that a user may only declare ``queue/<user>/…`` and ``exchange/<user>/…``.

:func:`prepare` runs on a plain connection: errors that no retry can fix (credentials,
permissions, a queue that exists with other arguments, missing exchanges) become
:class:`ConfigError` with a message that says what to do, instead of a robust connection retrying
them forever. A broker that is not up yet, or a connection that drops, is waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

import aio_pika
import aiormq.exceptions
import taskcluster
from aio_pika.abc import AbstractConnection

from coalescer.backoff import Backoff
from coalescer.errors import ConfigError
from coalescer.ingest import amqp
from coalescer.settings import redact_url

log = logging.getLogger(__name__)

#: The ``QueueEvents`` methods we bind to: every task state change.
STATE_EXCHANGES = ("taskPending", "taskRunning", "taskCompleted", "taskFailed", "taskException")
#: Exchange names don't depend on the deployment; the client insists on a root URL anyway.
_ANY_ROOT_URL = "https://taskcluster.invalid"


def bindings(prefix: str, root_url: str | None = None) -> list[tuple[str, str]]:
    """``(exchange, routing key pattern)`` per task state exchange: every message CC'ed to a
    ``<prefix>.…`` task route."""
    events = taskcluster.QueueEvents({"rootUrl": root_url or _ANY_ROOT_URL})
    found = []
    for method in STATE_EXCHANGES:
        ref = getattr(events, method)(f"route.{prefix}.#")
        found.append((str(ref["exchange"]), str(ref["routingKeyPattern"])))
    return found


def default_queue(pulse_url: str) -> str:
    """``queue/<user>/coalescer``, ``<user>`` from ``PULSE_URL``."""
    user = unquote(urlsplit(pulse_url).username or "guest")
    return f"queue/{user}/coalescer"


def dead_letter_names(queue: str) -> tuple[str, str]:
    """``(exchange, queue)`` for messages set aside from ``queue``: ``queue/<user>/x`` gets
    ``exchange/<user>/x/dead`` and ``queue/<user>/x/dead``."""
    if queue.startswith("queue/"):
        return "exchange/" + queue.removeprefix("queue/") + "/dead", queue + "/dead"
    return queue + "/dead", queue + "/dead"


def queue_arguments(queue: str, max_length: int) -> dict[str, Any]:
    # reject-publish: a full queue refuses new messages (the publisher is told) instead of
    # silently dropping its oldest ones, as the default drop-head would.
    return {
        "x-max-length": max_length,
        "x-overflow": "reject-publish",
        "x-dead-letter-exchange": dead_letter_names(queue)[0],
    }


#: What a connection that drops while declaring raises: it is opened again.
_LOST = (
    aiormq.exceptions.AMQPConnectionError,
    aiormq.exceptions.ChannelInvalidStateError,
    ConnectionError,
    TimeoutError,
)


async def prepare(
    url: str,
    queue: str,
    exchanges: Sequence[tuple[str, str]],
    *,
    max_length: int,
    declare_exchanges: bool,
    connection_name: str,
    stop: asyncio.Event,
) -> bool:
    """Check (or create) the exchanges; declare the dead-letter exchange and queue, and the
    queue. A broker that is not up yet, or a connection that drops meanwhile, is waited for and
    tried again. Returns ``False`` when ``stop`` was set while waiting for the broker."""
    backoff = Backoff(1.0, maximum=30.0)
    while True:
        connection = await _connect(url, connection_name, stop)
        if connection is None:
            return False
        delay = backoff.next()
        try:
            await _declare(connection, url, queue, exchanges, max_length, declare_exchanges)
            return True
        except _LOST as exc:
            log.warning(
                "lost the connection to %s while declaring %s (%s); retrying in %.0f s",
                redact_url(url),
                queue,
                str(exc) or type(exc).__name__,
                delay,
            )
        finally:
            with contextlib.suppress(*_LOST):
                await connection.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), delay)
        if stop.is_set():
            return False


async def _declare(
    connection: AbstractConnection,
    url: str,
    queue: str,
    exchanges: Sequence[tuple[str, str]],
    max_length: int,
    declare_exchanges: bool,
) -> None:
    dead_exchange, dead_queue = dead_letter_names(queue)
    try:
        for exchange, _ in exchanges:
            await _exchange(connection, exchange, declare_exchanges, url)
        channel = await connection.channel()
        dlx = await channel.declare_exchange(
            dead_exchange, aio_pika.ExchangeType.FANOUT, durable=True
        )
        dead = await channel.declare_queue(dead_queue, durable=True)
        await dead.bind(dlx, "#")
        await channel.declare_queue(
            queue, durable=True, arguments=queue_arguments(queue, max_length)
        )
        await channel.close()
    except aiormq.exceptions.ChannelPreconditionFailed as exc:
        raise ConfigError(
            f"queue {queue!r} exists with other arguments ({exc}); its maximum length comes "
            "from COALESCER_PULSE_MAX_LENGTH: restore it, or delete the queue once drained"
        ) from exc
    except aiormq.exceptions.ChannelAccessRefused as exc:
        raise ConfigError(
            f"the broker refused to declare {queue!r} or {dead_exchange!r} ({exc}); "
            "on Pulse, PULSE_QUEUE must start with queue/<user>/"
        ) from exc


def _certificate_error(exc: BaseException) -> ssl.SSLCertVerificationError | None:
    """The failed certificate check behind ``exc`` (aiormq wraps it), if that is what it is:
    retrying cannot fix it."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


async def _connect(url: str, name: str, stop: asyncio.Event) -> AbstractConnection | None:
    backoff = Backoff(1.0, maximum=30.0)
    while not stop.is_set():
        try:
            # The same heartbeat as the consumer's connection (aio-pika's default is 60 s).
            return await aio_pika.connect(
                url,
                client_properties={"connection_name": name + " (setup)"},
                timeout=10,
                heartbeat=amqp.heartbeat(url),
            )
        except (
            aiormq.exceptions.AuthenticationError,
            aiormq.exceptions.ProbableAuthenticationError,
        ) as exc:
            raise ConfigError(
                f"the broker at {redact_url(url)} refused PULSE_URL's credentials"
            ) from exc
        except (aiormq.exceptions.AMQPError, OSError, TimeoutError) as exc:
            if (untrusted := _certificate_error(exc)) is not None:
                raise ConfigError(
                    f"the broker at {redact_url(url)} has a certificate this machine does not "
                    f"trust ({untrusted.verify_message}); for a private CA, add "
                    "?cafile=/path/to/ca.pem to PULSE_URL or point SSL_CERT_FILE at it"
                ) from exc
            delay = backoff.next()
            log.warning(
                "broker at %s unreachable (%s); retrying in %.0f s",
                redact_url(url),
                str(exc) or type(exc).__name__,
                delay,
            )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), delay)
    return None


async def _exchange(connection: AbstractConnection, name: str, declare: bool, url: str) -> None:
    """Check ``name`` exists (a passive declare); create it only when asked: on Pulse the
    queue service owns it and declaring it is refused."""
    channel = await connection.channel()
    try:
        await channel.declare_exchange(name, passive=True)
    except aiormq.exceptions.ChannelNotFoundEntity as exc:
        if not declare:
            raise ConfigError(
                f"exchange {name!r} does not exist on {redact_url(url)}; "
                "on a bare RabbitMQ (tests, the emulator) pass --declare-exchanges"
            ) from exc
        channel = await connection.channel()  # the failed passive declare closed the first
        await channel.declare_exchange(name, aio_pika.ExchangeType.TOPIC, durable=True)
        log.warning("declared the missing exchange %s (topic, durable)", name)
    await channel.close()
