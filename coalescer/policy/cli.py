"""``coalescer enforce`` (carry out superseding decisions) and ``coalescer policy check``
(a policy file's rules; with ``--taskgraph``, what they do to a generated graph's keys).

``enforce`` needs ``REDIS_URL`` and the queue: ``TASKCLUSTER_ROOT_URL``,
``TASKCLUSTER_CLIENT_ID`` and ``TASKCLUSTER_ACCESS_TOKEN``; with the embedded store, ``coalescer
serve`` runs the enforcer itself (:mod:`coalescer.policy.embedded`). Stops cleanly on
SIGTERM/SIGINT (between rounds); a kill at any moment is safe too (see
:mod:`coalescer.policy.enforcer`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from functools import partial
from typing import Any

from coalescer.errors import ConfigError
from coalescer.settings import Settings, queue_credentials
from coalescer.worker.protocol import SupersedeAs

log = logging.getLogger("coalescer.policy")
#: Seconds between looks at the store (writable, evicting, emptied), as listen's.
WATCH_SECONDS = 5.0


def register(sub: Any) -> None:
    """Add ``enforce`` and ``policy`` to the ``coalescer`` command's subparsers."""
    p = sub.add_parser(
        "enforce",
        help="carry out superseding decisions (COALESCER_POLICY_FILE) on the queue",
        description="Consume the outboxes of keys whose policy rule supersedes on arrival: "
        "claim and resolve superseded pending tasks, cancel superseded running ones, cancel "
        "their dependents. Run one or more (they split the keys). Without a rule that "
        "decides on arrival (COALESCER_POLICY_FILE unset, or on-claim rules only) it warns "
        "once and idles until SIGTERM instead of exiting: a Procfile process that exits takes "
        "its sibling processes down with it.",
    )
    p.add_argument("--consumer", help="this enforcer's name (default host-pid)")
    p.add_argument("--worker-group", default="coalescer", help="the queue identity it claims as")
    p.add_argument("--worker-id", default="enforcer")
    p.add_argument(
        "--resolve-superseded-as",
        choices=[m.value for m in SupersedeAs],
        default=SupersedeAs.AUTO.value,
        help="auto (default): exception/superseded; where the queue rejects it, canceled, or "
        "released when the credentials may not cancel. completed shows superseded tasks as "
        "passed on every dashboard",
    )
    p.add_argument("--lease", type=float, default=60.0, metavar="S", help="key lease (60 s)")
    p.add_argument("--poll", type=float, default=1.0, metavar="S", help="idle wait (1 s)")
    p.add_argument("--tick", type=float, default=10.0, metavar="S", help="re-evaluate (10 s)")
    p.add_argument("--concurrency", type=int, default=8, metavar="N", help="keys at once (8)")
    p.add_argument("--metrics-port", type=int, metavar="PORT", help="serve /metrics here")
    p.set_defaults(handler=_enforce)

    check = sub.add_parser("policy", help="superseding policy tools")
    tools = check.add_subparsers(dest="policy_command", required=True, metavar="TOOL")
    c = tools.add_parser("check", help="validate a policy file and show its rules")
    c.add_argument(
        "file",
        nargs="?",
        help="the policy file: YAML, or TOML when it ends in .toml (default: "
        "COALESCER_POLICY_FILE; with neither, every key keeps on-claim)",
    )
    c.add_argument(
        "--key", action="append", default=[], metavar="KEY", help="show which rule KEY gets"
    )
    c.add_argument(
        "--taskgraph",
        metavar="FILE",
        help="a generated graph (`taskgraph full --json` output): say per coalescing key which "
        "rule governs it and whether its tasks will be superseded",
    )
    c.set_defaults(handler=_check)


def _check(args: argparse.Namespace, settings: Settings) -> int:
    from coalescer.model import check_key
    from coalescer.policy.rules import Policy, describe, load

    if args.file is not None:
        policy = load(args.file, named_by="policy file")
    else:
        policy = settings.policy or Policy()
    keys = [check_key(key) for key in args.key]
    graph = None
    if args.taskgraph is not None:
        from coalescer.policy.preview import load_graph

        graph = load_graph(args.taskgraph)
    for line in describe(policy) or ["no rules: every key keeps on-claim"]:
        print(line)
    for key in keys:
        rule = policy.rule_for(key)
        print(f"{key}: {rule.name} ({rule.strategy})")
    if graph is not None:
        from coalescer.policy.preview import explain

        for line in explain(graph, policy, settings.route_prefix, args.taskgraph):
            print(line)
    return 0


def _enforce(args: argparse.Namespace, settings: Settings) -> int:
    if settings.policy is None or not settings.policy.decides:
        # A Procfile process that exits takes its siblings down with it: idle instead.
        log.warning("no rule in COALESCER_POLICY_FILE decides on arrival: nothing to enforce")
        return asyncio.run(_idle())
    if settings.redis_url is None:
        raise ConfigError(
            "REDIS_URL is not set: the embedded store lives in one process; "
            "`coalescer serve` enforces the policy itself when the queue's credentials are set"
        )
    if settings.taskcluster_root_url is None:
        raise ConfigError("TASKCLUSTER_ROOT_URL is not set: say which queue to act on")
    return asyncio.run(_enforce_async(args, settings))


def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    return stop


async def _idle() -> int:
    await _stop_event().wait()
    return 0


async def _enforce_async(args: argparse.Namespace, settings: Settings) -> int:
    from coalescer.health import Health, Supervisor, watch_store
    from coalescer.policy.enforcer import connect
    from coalescer.store import open_store

    if args.metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port)
    stop = _stop_event()
    store = await open_store(settings.redis_url, grace_seconds=settings.grace_seconds)
    # Says in the log when Redis stops taking writes, may evict keys, or was emptied (the
    # decisions waiting in the outboxes are then lost), as serve and listen do.
    supervisor = Supervisor(Health())
    supervisor.every("watch-store", WATCH_SECONDS, partial(watch_store, store, supervisor.health))
    try:
        async with connect(
            store,
            settings.taskcluster_root_url or "",
            queue_credentials(),
            policy=settings.policy,
            worker_group=args.worker_group,
            worker_id=args.worker_id,
            supersede_as=SupersedeAs(args.resolve_superseded_as),
            public_url=settings.public_url,
            route_prefix=settings.route_prefix,
            rank_tag=settings.rank_tag,
            consumer=args.consumer,
            lease_ms=int(args.lease * 1000),
            poll=args.poll,
            tick=args.tick,
            concurrency=args.concurrency,
        ) as enforcer:
            log.info("enforcing as %s", enforcer.consumer)
            await enforcer.run(stop)
    finally:
        await supervisor.stop()
        await store.close()
    print("enforcer stopped", file=sys.stderr)
    return 0
