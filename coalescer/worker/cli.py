"""``coalescer worker``: the reference worker on the command line.

Queue credentials come from ``TASKCLUSTER_ROOT_URL``, ``TASKCLUSTER_CLIENT_ID`` and
``TASKCLUSTER_ACCESS_TOKEN`` (``taskcluster.optionsFromEnvironment()``), the token for reporting
bisections to the superseder service from ``--report-token-env`` or ``COALESCER_INGEST_TOKEN``.
SIGTERM or SIGINT stops claiming and releases held tasks with ``worker-shutdown``. With ``--livelog-port`` the
running tasks' logs are served live from this process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import signal
from typing import Any

import taskcluster

from coalescer.errors import ConfigError
from coalescer.settings import Secret, Settings
from coalescer.verdicts import DEFAULT_CONFIDENCE, DEFAULT_CONFIRM, DEFAULT_FLAKE
from coalescer.worker.protocol import OnPrimaryFailure, Options, Order, SupersedeAs

log = logging.getLogger("coalescer.worker")
_ID_RE = re.compile(r"^[a-zA-Z0-9-_]{1,38}$")


def register(subparsers: Any) -> None:
    """Add ``coalescer worker`` to the CLI."""
    p = subparsers.add_parser(
        "worker",
        help="run the reference worker: claim tasks, run command payloads, with superseding",
        description="The reference worker: claim tasks from a task queue, run their command "
        "payloads, and supersede with the service named by a task's supersederUrl. Queue "
        "credentials come from TASKCLUSTER_ROOT_URL, TASKCLUSTER_CLIENT_ID and "
        "TASKCLUSTER_ACCESS_TOKEN. SIGTERM or SIGINT stops claiming and releases held tasks.",
    )
    p.add_argument("--task-queue-id", required=True, metavar="P/W", help="task queue to claim from")
    p.add_argument("--worker-group", required=True, metavar="G", help="this worker's group")
    p.add_argument("--worker-id", required=True, metavar="I", help="this worker's id")
    p.add_argument(
        "--superseder-allow",
        action="append",
        default=[],
        metavar="PREFIX",
        help="follow supersederUrls under this URL prefix only (repeatable; none: never)",
    )
    p.add_argument("--capacity", type=int, default=1, help="task sets run at once (default 1)")
    p.add_argument("--superseder-timeout", type=float, default=5.0, metavar="S", help="default 5 s")
    p.add_argument(
        "--superseder-order",
        choices=[o.value for o in Order],
        default=Order.OLDEST_FIRST.value,
        help="newest-first for legacy tc-coalesce answers (default oldest-first)",
    )
    p.add_argument(
        "--resolve-superseded-as",
        choices=[m.value for m in SupersedeAs],
        default=SupersedeAs.AUTO.value,
        help="auto (default): exception/superseded; where the queue rejects it, canceled, or "
        "released when the credentials may not cancel. completed shows superseded tasks as "
        "passed on every dashboard",
    )
    p.add_argument(
        "--on-primary-failure",
        choices=[m.value for m in OnPrimaryFailure],
        default=OnPrimaryFailure.SUPERSEDE.value,
        help="what a failed primary does to the tasks it would supersede: supersede them "
        "(default), release them so that each runs, or bisect them to locate the first failing "
        "one (a few run, the others are superseded by the run that stands for them)",
    )
    p.add_argument(
        "--bisect-confirm",
        type=int,
        default=DEFAULT_CONFIRM,
        metavar="N",
        help="with bisect: rerun a failing task up to N times, until the failure is "
        "--bisect-confidence probably a breakage; a rerun that passes marks it intermittent "
        f"(default {DEFAULT_CONFIRM}; 0 trusts every failure)",
    )
    p.add_argument(
        "--bisect-confidence",
        type=float,
        default=DEFAULT_CONFIDENCE,
        metavar="P",
        help="with bisect: how probable a failure must be a breakage before the search "
        f"narrows on it, at a flake rate of {DEFAULT_FLAKE:g} (default {DEFAULT_CONFIDENCE:g})",
    )
    p.add_argument(
        "--report-token-env",
        metavar="NAME",
        help="with bisect: the environment variable holding the bearer token for the superseder "
        "service's POST /v1/bisections, where each finding is reported (default: "
        "COALESCER_INGEST_TOKEN when set; without a token findings are not reported)",
    )
    p.add_argument(
        "--max-supersede", type=int, default=32, metavar="N", help="tasks claimed per set at most"
    )
    p.add_argument(
        "--claim-concurrency", type=int, default=8, metavar="N", help="claims in flight at once"
    )
    p.add_argument(
        "--livelog-port",
        type=int,
        metavar="PORT",
        help="serve each running task's log live over HTTP on this port (0: any free port)",
    )
    p.add_argument(
        "--livelog-host",
        default="127.0.0.1",
        metavar="HOST",
        help="the host name users reach this worker by, in live log URLs (default 127.0.0.1)",
    )
    p.add_argument(
        "--livelog-bind",
        metavar="ADDR",
        help="the address the live log server listens on (default: --livelog-host)",
    )
    p.set_defaults(handler=handle)


def handle(args: argparse.Namespace, settings: Settings) -> int:
    """Run the worker until a signal stops it."""
    tc = taskcluster.optionsFromEnvironment()
    if not tc.get("rootUrl"):
        raise ConfigError("TASKCLUSTER_ROOT_URL is not set")
    if not re.fullmatch(r"[^/]+/[^/]+", args.task_queue_id):
        raise ConfigError(f"--task-queue-id {args.task_queue_id!r} is not <provisioner>/<type>")
    for name in ("worker_group", "worker_id"):
        if not _ID_RE.fullmatch(getattr(args, name)):
            raise ConfigError(f"--{name.replace('_', '-')} must be 1-38 of [a-zA-Z0-9-_]")
    if args.capacity < 1 or args.max_supersede < 1 or args.claim_concurrency < 1:
        raise ConfigError("--capacity, --max-supersede and --claim-concurrency must be >= 1")
    if args.bisect_confirm < 0:
        raise ConfigError("--bisect-confirm must be >= 0")
    if not 0.5 <= args.bisect_confidence < 1:
        raise ConfigError("--bisect-confidence must be from 0.5 to below 1")
    if args.livelog_port is not None and not 0 <= args.livelog_port <= 65535:
        raise ConfigError("--livelog-port must be 0-65535")
    report_token = settings.ingest_token
    if args.report_token_env is not None:
        value = os.environ.get(args.report_token_env)
        if not value:
            raise ConfigError(f"--report-token-env: {args.report_token_env} is not set")
        report_token = Secret(value)
    options = Options(
        allow=tuple(args.superseder_allow),
        timeout=args.superseder_timeout,
        order=Order(args.superseder_order),
        supersede_as=SupersedeAs(args.resolve_superseded_as),
        on_primary_failure=OnPrimaryFailure(args.on_primary_failure),
        bisect_confirm=args.bisect_confirm,
        bisect_confidence=args.bisect_confidence,
        report_token=report_token,
        route_prefix=settings.route_prefix,
        max_tasks=args.max_supersede,
        claim_concurrency=args.claim_concurrency,
    )
    if not options.allow:
        log.warning("no --superseder-allow prefix: every task runs alone (superseding is off)")
    if options.on_primary_failure is OnPrimaryFailure.BISECT and report_token is None:
        log.warning(
            "no report token (--report-token-env, COALESCER_INGEST_TOKEN): the culprits "
            "bisections locate are logged here but not reported to the superseder service"
        )
    asyncio.run(_main(args, tc, options))
    return 0


async def _main(args: argparse.Namespace, tc: dict[str, Any], options: Options) -> None:
    from coalescer.worker.livelog import LiveLogServer
    from coalescer.worker.runner import Worker
    from coalescer.worker.shim import Shim

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with contextlib.AsyncExitStack() as stack:
        livelog = None
        if args.livelog_port is not None:
            livelog = LiveLogServer(args.livelog_host, args.livelog_port, bind=args.livelog_bind)
            try:
                await stack.enter_async_context(livelog)
            except OSError as exc:
                raise ConfigError(
                    f"--livelog-port {args.livelog_port}: cannot listen on {livelog.bind}: "
                    f"{exc.strerror or exc}"
                ) from exc
            log.info("serving live logs at %s/log/<token>", livelog.base_url)
        shim = await stack.enter_async_context(
            Shim(
                root_url=tc["rootUrl"],
                credentials=tc.get("credentials"),
                worker_group=args.worker_group,
                worker_id=args.worker_id,
                options=options,
            )
        )
        await Worker(shim, args.task_queue_id, args.capacity, livelog).run(stop)
