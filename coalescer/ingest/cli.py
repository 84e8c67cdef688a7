"""``coalescer listen`` (the Pulse consumer) and ``coalescer reconcile`` (check against the queue).

Both need ``REDIS_URL``: the embedded store lives inside one process, so with it ``coalescer
serve`` runs the consumer itself and rebuilds the index from the queue at start
(:mod:`coalescer.ingest.startup`); there is nothing for another process to reach.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import re
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from coalescer.errors import CoalescerError, ConfigError, InvalidInput, StoreUnavailable
from coalescer.model import check_task_id
from coalescer.settings import Settings

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

#: The queue's ``taskQueueId`` pattern (``task.json``).
TASK_QUEUE_ID = re.compile(r"^[a-zA-Z0-9-_]{1,38}/[a-z]([-a-z0-9]{0,36}[a-z0-9])?$")


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
    listen.add_argument(
        "--record",
        metavar="FILE",
        help="append every applied event to FILE as a JSON line, for `coalescer replay --events` "
        "(default COALESCER_RECORD_FILE, else none)",
    )
    listen.add_argument(
        "--record-max-bytes",
        type=_positive,
        metavar="N",
        help="rotate FILE to FILE.1 once at N bytes, so at most two files exist "
        "(default COALESCER_RECORD_MAX_BYTES, else 256 MiB)",
    )
    listen.set_defaults(handler=_listen)

    rec = sub.add_parser(
        "reconcile",
        help="check indexed tasks against the queue (TASKCLUSTER_ROOT_URL) and fix the index",
        description="Ask the queue for the status of every task the index knows; apply what is "
        "newer, remove tasks the queue no longer knows. With --rebuild, rebuild a lost index "
        "from the queue's pending and claimed tasks instead. Prints a summary.",
    )
    rec.add_argument(
        "--rebuild",
        action="store_true",
        help="rebuild the index from the queue's listings (after Redis lost its data): the "
        "pending and claimed tasks of every active task queue, or of those given",
    )
    rec.add_argument(
        "--task-queue-id",
        action="append",
        default=[],
        type=_task_queue_id,
        metavar="ID",
        help="with --rebuild: list this task queue (repeatable; default every active one)",
    )
    rec.add_argument(
        "--task-group",
        action="append",
        default=[],
        type=_task_group_id,
        metavar="ID",
        help="with --rebuild: list this task group's tasks, for queues without the task "
        "queue listings (repeatable)",
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


def _task_queue_id(raw: str) -> str:
    if not TASK_QUEUE_ID.match(raw):
        raise argparse.ArgumentTypeError(
            f"not a taskQueueId: {raw!r} (expected <provisionerId>/<workerType>)"
        )
    return raw


def _task_group_id(raw: str) -> str:
    try:
        return check_task_id(raw)
    except InvalidInput as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("taskId", "taskGroupId")) from exc


def _need(settings: Settings, *names: str) -> None:
    if "pulse" in names and settings.pulse_url is None:
        raise ConfigError("PULSE_URL is not set: say which broker to consume from")
    if "root" in names and settings.taskcluster_root_url is None:
        raise ConfigError("TASKCLUSTER_ROOT_URL is not set: reconcile asks that queue")
    if settings.redis_url is None:
        itself = (
            "rebuilds the index from the queue at start when TASKCLUSTER_ROOT_URL is set"
            if "root" in names
            else "consumes Pulse itself when PULSE_URL is set"
        )
        raise ConfigError(
            f"REDIS_URL is not set: the embedded store lives in one process; `coalescer serve` "
            f"{itself}"
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
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        try:
            return runner.run(_listen_async(args, settings))
        except CoalescerError:
            raise  # a one-line message and its exit code (coalescer.cli)
        except Exception:
            # A bug, not a fault of the broker or the store (those are retried): said in the
            # log, as every other line, before the process exits for its supervisor to restart.
            log.critical(
                "listen stopped on an unexpected error; what it had not acknowledged is "
                "delivered again after a restart",
                exc_info=True,
            )
            return 1


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (as uvicorn serves on it): a consumer spends a
    good part of its time in the loop and its transports, and uvloop's are in C."""
    try:
        import uvloop
    except ImportError:  # not built for this platform: the standard loop does the same work
        return None
    return uvloop.new_event_loop


async def _listen_async(args: argparse.Namespace, settings: Settings) -> int:
    from coalescer.health import Health, Supervisor, watch_store
    from coalescer.ingest import amqp
    from coalescer.ingest.pulse import Consumer
    from coalescer.ingest.record import Recorder
    from coalescer.ingest.verify import Verifier
    from coalescer.observe import Observer
    from coalescer.store import open_store

    stop = _stop_event()
    asyncio.get_running_loop().set_exception_handler(amqp.on_loop_error)
    path = args.record or settings.record_file
    recorder = Recorder(path, args.record_max_bytes or settings.record_max_bytes) if path else None
    store = await open_store(settings.redis_url, grace_seconds=settings.grace_seconds)
    # Says in the log when Redis stops taking writes, may evict keys, or was emptied.
    supervisor = Supervisor(Health())
    supervisor.every("watch-store", 5.0, functools.partial(watch_store, store, supervisor.health))
    verifier = Verifier.from_settings(settings, store)
    try:
        consumer = Consumer(
            settings,
            store,
            Observer(store, retention=settings.retention),
            queue=args.queue,
            declare_exchanges=args.declare_exchanges,
            batch_size=args.batch,
            batch_wait=args.batch_wait_ms / 1000,
            drain_timeout=args.drain_timeout,
            recorder=recorder,
            verifier=verifier,
        )
        await consumer.run(stop)
    finally:
        await supervisor.stop()
        if verifier is not None:
            await verifier.close()
        await store.close()
        if recorder is not None:
            recorder.close()
    return 0


# -- reconcile ----------------------------------------------------------------------------------
def _reconcile(args: argparse.Namespace, settings: Settings) -> int:
    if not args.rebuild and (args.task_queue_id or args.task_group):
        raise ConfigError("--task-queue-id and --task-group go with --rebuild")
    if args.rebuild and args.every is not None:
        raise ConfigError("--rebuild runs once: run it without --every")
    _need(settings, "root")
    return asyncio.run(_reconcile_async(args, settings))


async def _reconcile_async(args: argparse.Namespace, settings: Settings) -> int:
    from coalescer.ingest.rebuild import queue_client
    from coalescer.store import open_store

    assert settings.taskcluster_root_url is not None  # checked by _need
    stop = _stop_event()
    store = await open_store(settings.redis_url, grace_seconds=settings.grace_seconds)
    try:
        async with queue_client(settings.taskcluster_root_url) as queue:
            while True:
                once = _rebuild(store, queue, args, settings) if args.rebuild else None
                round_ = asyncio.create_task(once or _reconcile_once(store, queue, args, settings))
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
                    if args.rebuild:
                        return 0 if summary.complete else 1
                    if args.every is None:
                        return 1 if summary.failed else 0
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), args.every)
                if stop.is_set():
                    return 0
    finally:
        await store.close()


async def _reconcile_once(
    store: Any, queue: Any, args: argparse.Namespace, settings: Settings
) -> Any:
    from tqdm import tqdm

    from coalescer.ingest.reconcile import indexed_tasks, queue_fetcher, reconcile
    from coalescer.store.census import Limits

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
            limits=Limits(settings.max_keys, settings.max_tasks),
        )
    summary.keys = keys
    return summary


async def _rebuild(store: Any, queue: Any, args: argparse.Namespace, settings: Settings) -> Any:
    from tqdm import tqdm

    from coalescer.ingest.rebuild import ListingFailed, rebuild_index
    from coalescer.store.census import Limits

    disable = None if args.progress is None else not args.progress
    with tqdm(total=0, desc="rebuild", unit="task", file=sys.stderr, disable=disable) as bar:

        def found(count: int) -> None:
            bar.total += count
            bar.refresh()

        try:
            return await rebuild_index(
                store,
                queue,
                prefix=settings.route_prefix,
                rank_tag=settings.rank_tag,
                task_queues=args.task_queue_id,
                task_groups=args.task_group,
                concurrency=args.concurrency,
                batch=args.batch,
                found=found,
                progress=bar.update,
                limits=Limits(settings.max_keys, settings.max_tasks),
            )
        except ListingFailed as exc:
            raise ConfigError(
                f"cannot find the active task queues: {exc} (or name them with --task-queue-id)"
            ) from exc
