"""The documentation keeps up with the code: every setting and every metric the package
defines is documented, and the generated references cover every route and command."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import re
import shlex
import subprocess
import sys
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
    r"""["']((?:COALESCER|PULSE|TASKCLUSTER|PROMETHEUS)_[A-Z_]+|REDIS_URL|PORT|SOURCE_COMMIT|"""
    r"""WEB_CONCURRENCY)["']"""
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


def _environment_reads(source: str) -> list[str]:
    """The names ``source`` reads from the environment: ``os.environ.get(NAME)``,
    ``os.environ[NAME]`` (not as the target of an assignment or ``del``), ``os.getenv(NAME)``."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and node.args:
            func = ast.unparse(node.func)
            if func.endswith(("environ.get", "getenv")):
                names.append(node.args[0])
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            if ast.unparse(node.value).endswith("environ"):
                names.append(node.slice)
    return [n.value for n in names if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_every_setting_is_read_through_settings_alone() -> None:
    """A documented setting is read from the environment in settings.py only (where it is
    validated), never elsewhere."""
    page = (DOCS / "reference" / "settings.md").read_text()
    documented = set(re.findall(r"^\| `([A-Z][A-Z0-9_]+)`", page, re.M))
    assert {"REDIS_URL", "WEB_CONCURRENCY", "SOURCE_COMMIT"} <= documented  # the scan works
    assert _environment_reads("os.environ['A'] = os.environ.get('B') or os.getenv('C')") == [
        "B",
        "C",
    ]
    elsewhere = sorted(
        f"{path.relative_to(ROOT)}: {name}"
        for path in PACKAGE.rglob("*.py")
        if path.name != "settings.py"
        for name in _environment_reads(path.read_text())
        if name in documented
    )
    assert not elsewhere, f"read these through coalescer.settings.Settings: {elsewhere}"


def test_no_metric_is_labelled_by_coalescing_key() -> None:
    """A series per key would make up to COALESCER_MAX_KEYS series: label by rule, source,
    outcome..., and keep per-key figures on the pages and the API."""
    labelled = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func).rsplit(".", 1)[-1]
            if name not in ("Counter", "Gauge", "Histogram", "Summary") and not name.endswith(
                "MetricFamily"
            ):
                continue
            labels = [
                *node.args[2:3],
                *(k.value for k in node.keywords if "label" in (k.arg or "")),
            ]
            for value in labels:
                if isinstance(value, ast.List | ast.Tuple) and any(
                    isinstance(e, ast.Constant) and e.value == "key" for e in value.elts
                ):
                    labelled.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not labelled, f"metrics labelled by key: {labelled}"


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


@pytest.mark.parametrize("folder", ["coalescer", "tests", "tests_taskcluster", "bench", "scripts"])
def test_no_comment_cites_a_document_outside_the_repository(folder: str) -> None:
    cited = [
        f"{path.relative_to(ROOT)}: {phrase}"
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path != Path(__file__).resolve()
        for phrase in ("SPEC", "seed 0", "seed's", "seeds/")
        if phrase in path.read_text()
    ]
    assert not cited, f"cite the repository's docs or a public document by name: {cited}"


_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
_PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def _blocks(*languages: str) -> list[tuple[str, str]]:
    return [
        (page.relative_to(ROOT).as_posix(), body)
        for page in _PAGES
        for lang, body in _FENCE.findall(page.read_text())
        if lang in languages
    ]


#: The width of a code block on the site's pages: longer lines are cut or scroll.
CODE_WIDTH = 84
#: Pages whose long code lines are left for now: the replay's report tables (as wide as the
#: report prints them), and the pages being rewritten with the replay's and the test command's
#: changes. Remove a page from here once its lines fit.
WIDE_PAGES = {
    "docs/how-to/replay.md",
    "docs/explanation/replay-model.md",
    "docs/reference/policy-file.md",
    "docs/development.md",
}


def test_every_code_line_fits_the_page() -> None:
    wide = [
        f"{page}: {len(line)}: {line[:40]}…"
        for page, body in _blocks(
            "", "text", "sh", "shell", "bash", "console", "python", "py", "json", "yaml", "toml"
        )
        if page.startswith("docs/") and page not in WIDE_PAGES
        for line in body.splitlines()
        if len(line) > CODE_WIDTH
    ]
    assert not wide, f"wrap these code lines at {CODE_WIDTH} characters: {wide}"


def test_every_drawing_is_text_that_renders_offline() -> None:
    """Mermaid needs a script from a CDN, and a drawing that does not parse shows as raw text:
    the drawings are text, which always renders."""
    assert _blocks("text"), "the scan finds the drawings"
    assert not _blocks("mermaid"), "draw it as text: Mermaid renders nothing offline"
    assert "mermaid" not in (ROOT / "mkdocs.yml").read_text()


def _shell_commands(block: str) -> list[list[str]]:
    """The commands of a shell snippet: continuation lines joined, comments dropped, split at
    ``&&``, ``||``, ``|``, ``;`` and ``&``, environment assignments in front removed."""
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        tokens = shlex.split(line, comments=True)
        current: list[str] = []
        for token in [*tokens, ";"]:
            if token in ("&&", "||", "|", ";", "&") or token.endswith(";"):
                if token.endswith(";") and token != ";":
                    current.append(token[:-1])
                while current and re.fullmatch(r"[A-Z_]+=.*", current[0]):
                    current.pop(0)
                if current:
                    commands.append(current)
                current = []
            else:
                current.append(token.removesuffix("&"))
    return commands


def test_every_shell_snippet_runs_as_written_once_the_venv_is_activated() -> None:
    """Every ``coalescer`` command in a snippet parses (its command and options exist), every
    ``make`` target exists, and every program the checkout provides is in ``.venv/bin``."""
    bin_dir = Path(sys.executable).parent
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    parser = build_parser()
    checked = 0
    for page, block in _blocks("sh", "shell", "bash", "console"):
        for argv in _shell_commands(block):
            program = argv[0].removeprefix(".venv/bin/")
            if program == "coalescer":
                try:
                    parser.parse_args(argv[1:])
                except SystemExit as exc:
                    raise AssertionError(f"{page}: {' '.join(argv)}") from exc
                checked += 1
            elif program == "make":
                # ``make soak SOAK_STORE=cluster``: a variable given on the command line
                wanted = {a for a in argv[1:] if "=" not in a}
                assert wanted <= targets, (page, argv)
            elif argv[0].startswith(".venv/bin/"):
                assert (bin_dir / program).exists(), (page, argv)
    assert checked >= 10


def test_every_python_snippet_compiles_and_its_imports_run_under_the_venvs_python() -> None:
    """The snippets' imports (``taskcluster``, ``coalescer.worker``…) are installed in the
    venv, where the README says to run them."""
    imports: set[str] = set()
    blocks = _blocks("python", "py")
    assert blocks
    for page, block in blocks:
        tree = compile(block, page, "exec", ast.PyCF_ONLY_AST)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imports.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imports.add(node.module)
    assert "taskcluster" in imports
    code = "; ".join(f"import {name}" for name in sorted(imports))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


def test_the_readme_says_early_how_to_get_the_command() -> None:
    readme = (ROOT / "README.md").read_text()
    first_use = min(readme.index("coalescer worker"), readme.index("coalescer demo"))
    assert -1 < readme.find(". .venv/bin/activate") < first_use
    assert "pipx install ." in readme
