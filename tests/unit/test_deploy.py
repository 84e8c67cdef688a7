"""deploy/: the Compose file and the Dockerfile run commands the CLI accepts, from files that
exist, and the image installs the hashed lock. (Neither is built or run by the suite; the
Procfile is run by tests/integration/test_procfile.py.)"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from coalescer.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def _compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    return doc


def _dockerfile() -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments left out."""
    text = re.sub(r"\\\n\s*", " ", (DEPLOY / "Dockerfile").read_text())
    return [line for line in text.splitlines() if line.strip() and not line.startswith("#")]


def _accepted(argv: list[str]) -> None:
    """``argv`` (``coalescer ...`` or ``python -m coalescer ...``) parses as a command."""
    if argv[:3] == ["python", "-m", "coalescer"]:
        argv = argv[3:]
    else:
        assert argv[0] == "coalescer", argv
        argv = argv[1:]
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"the CLI refuses {argv}: exit {exc.code}")


def test_every_compose_service_of_coalescer_runs_a_command_the_cli_accepts() -> None:
    compose = _compose()
    services = compose["services"]
    assert {"web", "worker", "redis", "rabbitmq"} <= set(services)
    ours = {n: s for n, s in services.items() if s.get("image") == "coalescer:local"}
    assert set(ours) == {"web", "worker", "emulator"}
    for service in ours.values():
        assert service["build"]["dockerfile"] == "deploy/Dockerfile"
        assert (DEPLOY / service["build"]["context"]).resolve() == ROOT.resolve()
        _accepted(service.get("command") or _cmd())
        for needed in service.get("depends_on", {}):
            assert needed in services


def test_compose_settings_are_the_service_s_own() -> None:
    env = _compose()["services"]["web"]["environment"]
    page = (ROOT / "docs" / "reference" / "settings.md").read_text()
    for name in env:
        assert f"`{name}`" in page, name


def _cmd() -> list[str]:
    (cmd,) = [line for line in _dockerfile() if line.startswith("CMD ")]
    argv: list[str] = json.loads(cmd.removeprefix("CMD "))
    return argv


def test_the_image_installs_the_hashed_lock_and_serves_by_default() -> None:
    lines = _dockerfile()
    assert any("--require-hashes -r requirements.txt" in line for line in lines)
    assert any("pip install --no-deps ." in line for line in lines)
    for line in lines:
        if line.startswith("COPY ") and "--from=" not in line:
            *sources, _ = shlex.split(line)[1:]
            for source in sources:
                assert list(ROOT.glob(source)) or source.endswith("*"), source
    assert _cmd() == ["coalescer", "serve"]
    _accepted(_cmd())


def test_every_procfile_process_runs_a_command_the_cli_accepts() -> None:
    processes = dict(
        line.split(": ", 1) for line in (ROOT / "Procfile").read_text().splitlines() if line
    )
    assert set(processes) == {"web", "worker", "enforce"}
    for command in processes.values():
        _accepted(shlex.split(command))
