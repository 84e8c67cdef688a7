"""The queue emulator as the soak runs it: ``coalescer emulator`` with claims that expire in
seconds rather than 20 minutes (so that a killed worker's run is retried within the soak), and
every published message kept, for the checker (``GET /emulator/v1/messages``).

    python -m tests.soak.emulator --port PORT --pulse-url URL [--claim-timeout S]
"""

from __future__ import annotations

import argparse

import uvicorn

from coalescer.emulator.runtime import EmulatorOptions
from coalescer.emulator.server import create_app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--pulse-url", required=True)
    parser.add_argument("--claim-timeout", type=float, default=12.0)
    args = parser.parse_args()
    options = EmulatorOptions(
        claim_work_timeout=2.0,
        claim_timeout=args.claim_timeout,
        pulse_url=args.pulse_url,
        keep_published=None,
    )
    uvicorn.run(
        create_app(options),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
        lifespan="on",
        ws="none",
    )


if __name__ == "__main__":
    main()
