"""``coalescer listen`` (the Pulse consumer) and ``coalescer reconcile`` (check against the queue).

Both need ``REDIS_URL``: the embedded store lives inside one process, so with it ``coalescer
serve`` runs the consumer itself, and there is nothing for another process to reconcile.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import signal
import sys
from typing import Any

from coalescer.errors import ConfigError, StoreUnavailable
from coalescer.settings import Settings

log = logging.getLogger(__name__)


def register(sub: Any) -> None:
    """Add ``listen`` and ``reconcile`` to the ``coalescer`` command's subparsers."""
    listen = sub.add_parser(
        "listen",
        help="consume task events from Pulse (PULSE_URL) into the index",
        description="Consume the queue's task events from Pulse (AMQP) into the index in "
        "REDIS_URL. Stops cleanly on SIGTERM (drains, never deletes its queue).",
    )
    listen.add_argument(
        "--queue", help="queue name (default PULSE_QUEUE, else queue/<user>/coalescer)"
    )
    listen.add_argument(
        "--declare-exchanges",
        action="store_true",
        help="create the queue's exchanges if missing (a bare RabbitMQ: tests, the emulator); "
        "real Pulse owns them and refuses this",
    )
    listen.add_argument(
        "--batch",
        type=_positive,
        metavar="N",
        help="apply up to N deliveries per Redis round trip (default half the prefetch)",
    )
    listen.add_argument(
        "--batch-wait-ms",
        type=float,
        default=5.0,
        metavar="MS",
        help="wait this long for a batch to fill (default 5)",
    )
    listen.add_argument(
        "--drain-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="on SIGTERM, finish what was delivered within this time (default 10); the rest "
        "goes back to the queue",
    )
    listen.set_defaults(handler=_listen)

    rec = sub.add_parser(
        "reconcile",
        help="check indexed tasks against the queue (TASKCLUSTER_ROOT_URL) and fix the index",
        description="Ask the queue for the status of every task the index knows; apply what is "
        "newer, remove tasks the queue no longer knows. Prints a summary.",
    )
    rec.add_argument(
        "--every",
        type=float,
        metavar="SECONDS",
        help="run again every SECONDS until SIGTERM (a periodic process)",
    )
    rec.add_argument(
        "--concurrency",
        type=_positive,
        default=4,
        metavar="N",
        help="status requests in flight (default 4)",
    )
    rec.add_argument(
        "--batch",
        type=_positive,
        default=500,
        metavar="N",
        help="tasks per status request (default 500; a queue without the bulk endpoint is "
        "asked task by task, N at once)",
    )
    rec.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )
    rec.set_defaults(handler=_reconcile)


def _positive(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _need(settings: Settings, *names: str) -> None:
    if "pulse" in names and settings.pulse_url is None:
        raise ConfigError("PULSE_URL is not set: say which broker to consume from")
    if "root" in names and settings.taskcluster_root_url is None:
        raise ConfigError("TASKCLUSTER_ROOT_URL is not set: reconcile asks that queue")
    if settings.redis_url is None:
        raise ConfigError(
            "REDIS_URL is not set: the embedded store lives in one process; "
            "`coalescer serve` consumes Pulse itself when PULSE_URL is set"
        )


def _stop_event() -> asyncio.Event:
    """Set on SIGTERM or SIGINT, so that the process stops between batches, not mid-write."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        log.info("received %s: stopping", signal.Signals(signum).name)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    return stop


# -- listen -------------------------------------------------------------------------------------
def _listen(args: argparse.Namespace, settings: Settings) -> int:
    _need(settings, "pulse")
    return asyncio.run(_listen_async(args, settings))


async def _listen_async(args: argparse.Namespace, settings: Settings) -> int:
    from coalescer.health import Health, Supervisor, watch_store
    from coalescer.ingest.pulse import Consumer
    from coalescer.observe import Observer
    from coalescer.store import open_store

    stop = _stop_event()
    store = await open_store(settings.redis_url, grace_seconds=settings.grace_seconds)
    # Says in the log when Redis stops taking writes, may evict keys, or was emptied.
    supervisor = Supervisor(Health())
    supervisor.every("watch-store", 5.0, functools.partial(watch_store, store, supervisor.health))
    try:
        consumer = Consumer(
            settings,
            store,
            Observer(store),
            queue=args.queue,
            declare_exchanges=args.declare_exchanges,
            batch_size=args.batch,
            batch_wait=args.batch_wait_ms / 1000,
            drain_timeout=args.drain_timeout,
        )
        await consumer.run(stop)
    finally:
        await supervisor.stop()
        await store.close()
    return 0


# -- reconcile ----------------------------------------------------------------------------------
def _reconcile(args: argparse.Namespace, settings: Settings) -> int:
    _need(settings, "root")
    return asyncio.run(_reconcile_async(args, settings))


async def _reconcile_async(args: argparse.Namespace, settings: Settings) -> int:
    import taskcluster.aio

    from coalescer.store import open_store

    stop = _stop_event()
    store = await open_store(settings.redis_url, grace_seconds=settings.grace_seconds)
    try:
        async with taskcluster.aio.createSession() as session:
            queue = taskcluster.aio.Queue(
                {"rootUrl": settings.taskcluster_root_url, "maxRetries": 3}, session=session
            )
            while True:
                round_ = asyncio.create_task(_reconcile_once(store, queue, args))
                stopped = asyncio.create_task(stop.wait())
                await asyncio.wait({round_, stopped}, return_when=asyncio.FIRST_COMPLETED)
                stopped.cancel()
                if not round_.done():  # stopped mid-run: what is applied is applied
                    round_.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await round_
                    return 130
                try:
                    summary = round_.result()
                except StoreUnavailable as exc:
                    if args.every is None:
                        raise
                    log.error("reconcile failed: %s", exc)
                else:
                    print(summary.line(), flush=True)
                    if args.every is None:
                        return 1 if summary.failed else 0
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), args.every)
                if stop.is_set():
                    return 0
    finally:
        await store.close()


async def _reconcile_once(store: Any, queue: Any, args: argparse.Namespace) -> Any:
    from tqdm import tqdm

    from coalescer.ingest.reconcile import indexed_tasks, queue_fetcher, reconcile

    keys, tasks = await indexed_tasks(store)
    disable = None if args.progress is None else not args.progress
    with tqdm(
        total=len(tasks), desc="reconcile", unit="task", file=sys.stderr, disable=disable
    ) as bar:
        summary = await reconcile(
            store,
            tasks,
            queue_fetcher(queue),
            concurrency=args.concurrency,
            batch=args.batch,
            progress=bar.update,
        )
    summary.keys = keys
    return summary
