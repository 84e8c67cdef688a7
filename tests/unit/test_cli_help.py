"""Every command's ``--help`` reads as plain text: a description, no reST markup, and every
option's default shown."""

from __future__ import annotations

import argparse

import pytest

from coalescer.cli import build_parser


def _commands(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += [sub, *_commands(sub)]
    return found


COMMANDS = {sub.prog: sub for sub in _commands(build_parser())}


def test_the_scan_finds_every_command() -> None:
    assert {"coalescer serve", "coalescer demo", "coalescer worker", "coalescer enforce"} <= set(
        COMMANDS
    )


@pytest.mark.parametrize("prog", sorted(COMMANDS))
def test_a_commands_help_has_a_description_and_no_rest_markup(prog: str) -> None:
    sub = COMMANDS[prog]
    has_subcommands = any(isinstance(a, argparse._SubParsersAction) for a in sub._actions)
    assert sub.description or has_subcommands, f"{prog} --help has no description"
    text = sub.format_help()
    for markup in ("``", ":mod:", ":class:", ":func:"):
        assert markup not in text, f"{prog} --help shows {markup!r}"


@pytest.mark.parametrize("prog", sorted(COMMANDS))
def test_every_option_with_a_default_says_it(prog: str) -> None:
    for action in COMMANDS[prog]._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        if isinstance(action, argparse._HelpAction | argparse._VersionAction):
            continue
        assert action.help, (prog, action.option_strings, "no help")
        if action.required:
            assert "required" in action.help, (prog, action.option_strings)
        elif action.default not in (None, False, [], argparse.SUPPRESS):
            default = action.default
            shown = f"{default:g}" if isinstance(default, float) else str(default)
            assert "default" in action.help or f"({shown}" in action.help, (
                prog,
                action.option_strings,
                action.help,
            )


def test_enforce_says_why_it_idles_without_a_deciding_rule() -> None:
    text = " ".join(COMMANDS["coalescer enforce"].format_help().split())
    assert "idles until SIGTERM instead of exiting" in text
