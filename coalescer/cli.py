"""``coalescer`` — the command line: serve, listen, reconcile, worker, emulator, demo.

Errors become one-line messages and exit codes: 2 for bad settings or arguments, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence

from coalescer import __version__
from coalescer.errors import CoalescerError, ConfigError
from coalescer.settings import Settings

log = logging.getLogger("coalescer")

#: Modules that add their own subcommands with ``register(subparsers)``.
PLUGINS = (
    "coalescer.ingest.cli",
    "coalescer.worker.cli",
    "coalescer.emulator.cli",
    "coalescer.policy.cli",
    "coalescer.replay.cli",
    "coalescer.demo",
)


def _serve(args: argparse.Namespace, settings: Settings) -> int:
    from coalescer.web.app import create_app
    from coalescer.web.server import serve

    host = args.host or settings.host
    port = settings.port if args.port is None else args.port
    log.info(
        "serving on http://%s:%d (store: %s)",
        host,
        port,
        "redis" if settings.redis_url else "embedded",
    )
    serve(create_app(settings), host=host, port=port, max_header_bytes=settings.max_header_bytes)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="coalescer",
        description="A superseder service for Taskcluster-style task queues, its worker shim, "
        "a queue emulator and their tools.",
    )
    parser.add_argument("--version", action="version", version=f"coalescer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser("serve", help="run the superseder web service")
    serve.add_argument("--host", help="interface to bind (default COALESCER_HOST or 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default PORT or 8000)")
    serve.set_defaults(handler=_serve)
    for name in PLUGINS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = Settings.from_environ()
    except ConfigError as exc:
        print(f"coalescer: {exc}", file=sys.stderr)
        return 2
    from coalescer import logs

    logs.setup(settings.log_level, settings.log_json)
    handler: Callable[[argparse.Namespace, Settings], int] = args.handler
    try:
        return handler(args, settings)
    except ConfigError as exc:
        print(f"coalescer: {exc}", file=sys.stderr)
        return 2
    except CoalescerError as exc:
        print(f"coalescer: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
