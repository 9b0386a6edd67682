"""Tier (a), no processes: every argument of the ``commfuse`` command and of each subcommand, at every depth,
has help text, so ``--help`` explains every option it lists."""

from __future__ import annotations

import argparse

from commfuse.cli import COMMANDS, parser


def _walk(p: argparse.ArgumentParser, path: tuple[str, ...] = ("commfuse",)):
    """(command path, parser) for ``p`` and every subcommand under it."""
    yield path, p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, (*path, name))


def _missing_help(path: tuple[str, ...], p: argparse.ArgumentParser) -> list[str]:
    missing = []
    for action in p._actions:
        shown = "/".join(action.option_strings) or action.metavar or action.dest
        if not action.help or action.help == argparse.SUPPRESS or not str(action.help).strip():
            missing.append(f"{' '.join(path)}: {shown}")
        if isinstance(action, argparse._SubParsersAction):
            helped = {choice.dest: choice.help for choice in action._choices_actions}
            missing += [f"{' '.join(path)} {name} (the subcommand)" for name in action.choices if not helped.get(name)]
    return missing


def test_the_walk_reaches_every_command_and_their_subcommands():
    paths = {path for path, _ in _walk(parser())}
    assert {("commfuse", name) for name, *_ in COMMANDS} <= paths
    # the nested ones: schedule's actions and simulate's
    assert {("commfuse", "schedule", "show"), ("commfuse", "schedule", "dump"),
            ("commfuse", "simulate", "calibrate"), ("commfuse", "simulate", "profiles")} <= paths
    assert {name for name, *_ in COMMANDS} >= {"schedule", "backends", "bench", "simulate", "conformance"}


def test_every_option_and_positional_has_help():
    missing = [m for path, p in _walk(parser()) for m in _missing_help(path, p)]
    assert not missing, "arguments without help text:\n  " + "\n  ".join(missing)
    for path, p in _walk(parser()):
        assert "usage:" in p.format_help(), path  # a stray % in a help string would raise here


def test_the_check_catches_an_argument_without_help():
    p = argparse.ArgumentParser(prog="demo")
    p.add_argument("--helped", help="has some")
    sub = p.add_subparsers(dest="action", help="what to do")
    bare = sub.add_parser("bare")
    bare.add_argument("thing")
    found = [m for path, q in _walk(p, ("demo",)) for m in _missing_help(path, q)]
    assert found == ["demo bare (the subcommand)", "demo bare: thing"], found
