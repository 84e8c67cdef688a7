"""MkDocs hooks: the reference pages that are generated from the code at build time.

A page holds a marker line, and the build replaces it:

* ``<!-- generated: http-api -->`` with every route of the OpenAPI document
  (``coalescer.web.openapi.document()``) and every answer shape in its components;
* ``<!-- generated: cli -->`` with every command and option of ``coalescer.cli.build_parser()``.

So the reference cannot drift from the service: a renamed field or a new option shows up in the
next build. Nothing here names a field or an option.
"""

from __future__ import annotations

import argparse
import re
import textwrap
from typing import Any

HTTP_API = "<!-- generated: http-api -->"
CLI = "<!-- generated: cli -->"

_METHODS = ("get", "head", "post", "put", "patch", "delete")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if HTTP_API in markdown:
        from coalescer.web.openapi import document

        markdown = markdown.replace(HTTP_API, render_openapi(document()))
    if CLI in markdown:
        from coalescer.cli import build_parser

        markdown = markdown.replace(CLI, render_cli(build_parser()))
    return markdown


# --- the HTTP API ---------------------------------------------------------------------------


def _text(value: Any) -> str:
    """A description as Markdown for a table cell: reST's ````code```` becomes ```code```, all
    on one line, ``|`` escaped, and ``<`` ``>`` outside code shown as text, not read as HTML."""
    text = re.sub(r"``(.+?)``", r"`\1`", str(value or ""))
    parts = " ".join(text.split()).replace("|", "\\|").split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _schema_anchor(name: str) -> str:
    return f"schema-{_slug(name)}"


def _type(schema: dict[str, Any]) -> str:
    """A short human form of a JSON schema: ``string``, ``integer ≥ 0``, ``[Supersedes]``…"""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{_schema_anchor(name)})"
    for combinator, word in (("anyOf", " or "), ("oneOf", " or "), ("allOf", " and ")):
        if combinator in schema:
            return word.join(_type(s) for s in schema[combinator])
    if "const" in schema:
        return f"`{schema['const']!r}`".replace("''", '""')
    if "enum" in schema:
        return "one of " + ", ".join(f"`{v}`" for v in schema["enum"])
    kind: str | list[str] = schema.get("type", "any")
    if isinstance(kind, list):
        kind = " or ".join(kind)
    if kind == "array" and "items" in schema:
        kind = f"array of {_type(schema['items'])}"
    bounds = []
    if "minimum" in schema:
        bounds.append(f"≥ {schema['minimum']:,}")
    if "maximum" in schema:
        bounds.append(f"≤ {schema['maximum']:,}")
    if "maxLength" in schema:
        bounds.append(f"at most {schema['maxLength']} characters")
    if "maxItems" in schema:
        bounds.append(f"at most {schema['maxItems']:,} items")
    if "pattern" in schema:
        bounds.append(f"matching `{schema['pattern']}`")
    return kind + (f" ({', '.join(bounds)})" if bounds else "")


def _fields(schema: dict[str, Any], prefix: str = "") -> list[tuple[str, str, bool, str]]:
    """``(field, type, required, description)`` of an object schema, nested objects flattened
    as ``outer.inner`` and arrays of objects as ``outer[].inner``."""
    rows: list[tuple[str, str, bool, str]] = []
    required = set(schema.get("required", ()))
    for name, sub in schema.get("properties", {}).items():
        field = f"{prefix}{name}"
        rows.append((field, _type(sub), name in required, _text(sub.get("description"))))
        if sub.get("properties"):
            rows += _fields(sub, f"{field}.")
        items = sub.get("items")
        if isinstance(items, dict) and items.get("properties"):
            rows += _fields(items, f"{field}[].")
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):
        rows.append((f"{prefix}<any name>", _type(extra), False, ""))
    return rows


def _schema_block(schema: dict[str, Any]) -> list[str]:
    rows = _fields(schema)
    if not rows:
        return [f"Body: {_type(schema)}.", ""]
    lines = ["| field | type | required | description |", "|---|---|---|---|"]
    lines += [
        f"| `{field}` | {kind} | {'yes' if req else ''} | {desc} |"
        for field, kind, req, desc in rows
    ]
    return [*lines, ""]


def render_openapi(doc: dict[str, Any]) -> str:
    """The OpenAPI document as Markdown: one section per operation, then the answer shapes."""
    out: list[str] = []
    info = doc.get("info", {})
    if info.get("description"):
        out += [_text(info["description"]), ""]
    out += [f"OpenAPI {doc.get('openapi', '')}, API version {info.get('version', '')}.", ""]
    schemes = doc.get("components", {}).get("securitySchemes", {})
    for path, item in doc.get("paths", {}).items():
        for method in _METHODS:
            op = item.get(method)
            if op is None:
                continue
            title = f"{method.upper()} {path}"
            out += [f"### `{title}` {{#{_slug(title)}}}", "", _text(op.get("summary")), ""]
            for requirement in op.get("security", ()):
                for name in requirement:
                    scheme = schemes.get(name, {})
                    out += [
                        f"Authentication: HTTP `{scheme.get('scheme', name)}` "
                        "(`Authorization: Bearer <token>`).",
                        "",
                    ]
            params = op.get("parameters", ())
            if params:
                out += [
                    "| parameter | in | required | type | description |",
                    "|---|---|---|---|---|",
                ]
                out += [
                    f"| `{p['name']}` | {p['in']} | {'yes' if p.get('required') else ''} "
                    f"| {_type(p.get('schema', {}))} | {_text(p.get('description'))} |"
                    for p in params
                ]
                out.append("")
            body = op.get("requestBody")
            if body:
                for media, content in body.get("content", {}).items():
                    out += [f"Request body (`{media}`): {_type(content.get('schema', {}))}.", ""]
            out += ["| status | meaning | body |", "|---|---|---|"]
            for status, response in op.get("responses", {}).items():
                bodies = [
                    f"{_type(c.get('schema', {}))} (`{media}`)"
                    for media, c in response.get("content", {}).items()
                ]
                out.append(
                    f"| {status} | {_text(response.get('description'))} | {'; '.join(bodies)} |"
                )
            out.append("")
    shapes = doc.get("components", {}).get("schemas", {})
    if shapes:
        out += ["## Answer shapes", ""]
        for name, schema in shapes.items():
            out += [f"### {name} {{#{_schema_anchor(name)}}}", ""]
            if schema.get("description"):
                out += [_text(schema["description"]), ""]
            out += _schema_block(schema)
    return "\n".join(out)


# --- the command line -----------------------------------------------------------------------


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser, str]]:
    """``(name, parser, help)`` of a parser's subcommands, in the order they were added."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            found += [(n, p, helps.get(n, "")) for n, p in action.choices.items()]
    return found


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help:
        return ""
    formatter = parser._get_formatter()
    return formatter._expand_help(action)


def _option_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction | argparse._HelpAction):
            continue
        if action.help == argparse.SUPPRESS:
            continue
        suffix = ""
        if action.option_strings and action.nargs != 0:
            metavar = action.metavar or (
                "{" + ",".join(map(str, action.choices)) + "}"
                if action.choices
                else action.dest.upper()
            )
            suffix = f" {metavar}"
        flags = action.option_strings or [str(action.metavar or action.dest)]
        names = ", ".join(f"`{flag}{suffix}`" for flag in flags)
        default = action.default
        shown = "" if default in (None, False, argparse.SUPPRESS, []) else f"`{default}`"
        rows.append(f"| {names} | {_text(_help(parser, action))} | {shown} |")
    return rows


def render_cli(parser: argparse.ArgumentParser, depth: int = 2) -> str:
    """Every subcommand of ``parser`` (recursively) with its usage and options."""
    out: list[str] = []
    for _name, sub, help_ in _subcommands(parser):
        title = sub.prog
        out += [f"{'#' * depth} `{title}` {{#{_slug(title)}}}", ""]
        sentence = help_[:1].upper() + help_[1:] + "." if help_ else ""
        if sentence:
            out += [_text(sentence), ""]
        if sub.description and sub.description not in (help_, sentence):
            out += [_text(sub.description), ""]
        usage = textwrap.dedent(
            " " * len("usage: ") + sub.format_usage().removeprefix("usage: ")
        ).strip()
        out += ["```", usage, "```", ""]
        rows = _option_rows(sub)
        if rows:
            out += ["| option | meaning | default |", "|---|---|---|", *rows, ""]
        if sub.epilog:
            out += [_text(sub.epilog), ""]
        out.append(render_cli(sub, depth + 1))
    return "\n".join(out)
