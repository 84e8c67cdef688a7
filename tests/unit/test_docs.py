"""The documentation keeps up with the code: every setting and every metric the package
defines is documented, and the generated references cover every route and command."""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

from coalescer.cli import build_parser
from coalescer.web.openapi import document

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "coalescer"
DOCS = ROOT / "docs"

#: Environment variables the package reads: ours, and the platform's and Taskcluster's names.
_SETTING = re.compile(
    r"""["']((?:COALESCER|PULSE|TASKCLUSTER|PROMETHEUS)_[A-Z_]+|REDIS_URL|PORT|SOURCE_COMMIT)["']"""
)
#: A metric's name where it is defined: a prometheus-client constructor, or a name followed by
#: its help text in a table of gauges.
_METRIC = re.compile(
    r"""(?:Counter|Gauge|Histogram|Summary|MetricFamily)\(\s*"(coalescer_\w+)"|"""
    r"""\(\s*"(coalescer_\w+)",\s*"[A-Z0-9]"""
)


def _sources() -> str:
    return "\n".join(p.read_text() for p in sorted(PACKAGE.rglob("*.py")))


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "mkdocs_hooks", ROOT / "scripts" / "mkdocs_hooks.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_setting_the_package_reads_is_documented() -> None:
    names = set(_SETTING.findall(_sources()))
    assert {"REDIS_URL", "COALESCER_INGEST_TOKEN", "PULSE_URL"} <= names  # the scan works
    page = (DOCS / "reference" / "settings.md").read_text()
    missing = sorted(n for n in names if f"`{n}`" not in page)
    assert not missing, f"add these to docs/reference/settings.md: {missing}"


def test_every_metric_the_package_defines_is_documented() -> None:
    names = {a or b for a, b in _METRIC.findall(_sources())}
    assert {"coalescer_events", "coalescer_store_up", "coalescer_index_complete"} <= names
    page = (DOCS / "reference" / "metrics.md").read_text()
    missing = sorted(n for n in names if not re.search(rf"`{n}(_total)?[`{{]", page))
    assert not missing, f"add these to docs/reference/metrics.md: {missing}"


def test_the_http_reference_has_every_operation_and_field_of_the_openapi_document() -> None:
    doc = document()
    text = _hooks().render_openapi(doc)
    for path, item in doc["paths"].items():
        for method in item:
            assert f"`{method.upper()} {path}`" in text
    for name, schema in doc["components"]["schemas"].items():
        assert f"### {name} " in text
        for field in schema.get("properties", {}):
            assert f"`{field}`" in text


def _commands(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += [sub, *_commands(sub)]
    return found


def test_the_cli_reference_has_every_command_and_option() -> None:
    parser = build_parser()
    text = _hooks().render_cli(parser)
    commands = _commands(parser)
    assert len(commands) >= 9
    for sub in commands:
        assert f"`{sub.prog}`" in text
        for action in sub._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            for flag in action.option_strings:
                assert f"`{flag}" in text, (sub.prog, flag)


@pytest.mark.parametrize(
    "page",
    [*sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")), "../README.md"],
)
def test_no_page_names_documents_a_reader_does_not_have(page: str) -> None:
    text = (DOCS / page).read_text()
    for phrase in ("SPEC §", "seed 0", "this machine", "2-core machine", "the day before"):
        assert phrase not in text, f"{page} mentions {phrase!r}"
