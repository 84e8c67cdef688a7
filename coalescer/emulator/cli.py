"""``coalescer emulator``: serve an in-memory queue emulator for tests and demos."""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coalescer.emulator.runtime import EmulatorOptions
    from coalescer.settings import Settings

log = logging.getLogger("coalescer.emulator")


def register(subparsers: Any) -> None:
    """Add the ``emulator`` subcommand to an argparse ``add_subparsers()`` object."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "emulator",
        help="serve an in-memory Taskcluster queue emulator (tests and demos)",
        description=(
            "Serve the Taskcluster queue's worker-facing API under /api/queue/v1/ (use "
            "http://HOST:PORT as the taskcluster client's rootUrl), keeping all state in memory, "
            "and publish its Pulse messages."
        ),
    )
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8081, help="port (default 8081)")
    parser.add_argument(
        "--pulse-url", metavar="URL", help="AMQP URL to publish Pulse messages to (e.g. RabbitMQ)"
    )
    parser.add_argument(
        "--publish-to",
        metavar="URL",
        help="POST messages to this coalescer ingest URL (http://.../v1/events), with the bearer "
        "token from COALESCER_INGEST_TOKEN",
    )
    parser.add_argument(
        "--legacy",
        action="store_true",
        help='behave like a pre-v40 queue: accept reportException reason "superseded"',
    )
    parser.add_argument(
        "--controllable-clock",
        action="store_true",
        help='serve POST /emulator/v1/clock {"advance": seconds} to move time forward',
    )
    parser.add_argument(
        "--claim-work-timeout",
        type=float,
        default=20.0,
        metavar="SECONDS",
        help="longest a claimWork call waits for work (default 20)",
    )
    parser.add_argument(
        "--claim-timeout",
        type=float,
        default=1200.0,
        metavar="SECONDS",
        help="seconds from a claim or reclaim to its takenUntil (default 1200, the real "
        "queue's; its TASK_CLAIM_TIMEOUT)",
    )
    parser.add_argument(
        "--deadline-delay",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long after its deadline an unresolved task is resolved deadline-exceeded "
        "(default 60, the real queue's)",
    )
    parser.set_defaults(handler=run)


def options(args: argparse.Namespace, settings: Settings) -> EmulatorOptions:
    """The emulator's options from the command line; :class:`ConfigError` for bad ones."""
    from coalescer.emulator.runtime import EmulatorOptions
    from coalescer.errors import ConfigError
    from coalescer.settings import amqp_url

    amqp_url(args.pulse_url or None, "--pulse-url")
    if args.publish_to and not args.publish_to.startswith(("http://", "https://")):
        raise ConfigError("--publish-to must be an http:// or https:// URL")
    if args.claim_work_timeout < 0:
        raise ConfigError("--claim-work-timeout must not be negative")
    if not args.claim_timeout > 0:
        raise ConfigError("--claim-timeout must be more than 0")
    if args.deadline_delay < 0:
        raise ConfigError("--deadline-delay must not be negative")
    token = settings.ingest_token.reveal() if settings.ingest_token else None
    return EmulatorOptions(
        legacy=args.legacy,
        controllable_clock=args.controllable_clock,
        claim_work_timeout=args.claim_work_timeout,
        claim_timeout=args.claim_timeout,
        deadline_delay=args.deadline_delay,
        pulse_url=args.pulse_url,
        publish_to=args.publish_to,
        ingest_token=token,
    )


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Serve the emulator with uvicorn until interrupted."""
    import uvicorn

    from coalescer.emulator.server import KEEP_ALIVE_SECONDS, create_app

    served = options(args, settings)
    log.warning(
        "queue emulator on http://%s:%d (rootUrl) — state is in memory only, for tests and demos",
        args.host,
        args.port,
    )
    uvicorn.run(
        create_app(served),
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        lifespan="on",
        ws="none",
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
    )
    return 0
