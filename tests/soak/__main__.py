"""``python -m tests.soak --duration 600 --store redis --report DIR``: run the chaos soak and
exit 1 on any invariant violation (printed, and in ``DIR/report.json`` and ``report.html``)."""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from pathlib import Path

from tests.soak.config import Config
from tests.soak.runner import Soak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of faults and load")
    parser.add_argument("--store", choices=("redis", "cluster"), default="redis")
    parser.add_argument("--report", type=Path, default=None, help="report directory")
    parser.add_argument("--seed", type=int, default=None, help="the faults' RNG seed")
    parser.add_argument("--rate", type=float, default=4.0, help="pushes a second")
    parser.add_argument(
        "--settle",
        type=float,
        default=300.0,
        help="longest wait for the queue to settle after the run (the enforcer's bisections "
        "begun late in a 10-minute run took more than 90 s)",
    )
    parser.add_argument("--faults", default="", help="draw only these kinds (comma-separated)")
    parser.add_argument(
        "--min-faults",
        type=int,
        default=5,
        help="inject faults past the duration until this many were (a loaded machine fits "
        "fewer in the same time)",
    )
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    report = args.report or Path(f"soak-report-{time.strftime('%Y%m%d-%H%M%S')}")
    amqp = os.environ.get("COALESCER_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
    config = Config(
        args.duration,
        args.store,
        report,
        seed,
        amqp,
        rate=args.rate,
        settle=args.settle,
        only=tuple(filter(None, args.faults.split(","))),
        min_faults=args.min_faults,
    )
    print(
        f"soak: {args.duration:.0f} s on {args.store}, seed {seed}, report in {report}", flush=True
    )
    return asyncio.run(Soak(config).run())


if __name__ == "__main__":
    sys.exit(main())
