"""`dz ... --help` explains itself: every option says what it does, shows its default, and every command ends
with an example command line that the parser accepts."""

import argparse
import shlex

import pytest

from dzmodel.cli import build_parser


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("dz",)):
    """(path, parser, is_leaf) for the root and every subcommand, depth first."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    yield path, parser, not subs
    for action in subs:
        for name, child in action.choices.items():
            yield from _commands(child, (*path, name))


COMMANDS = list(_commands(build_parser()))
LEAVES = [(path, p) for path, p, leaf in COMMANDS if leaf]


def _name(value):
    return " ".join(value) if isinstance(value, tuple) else None


def _example_lines(epilog: str) -> list[str]:
    """The command lines of an epilog: every line but its `example:`/`examples:` heading."""
    return [line.strip() for line in epilog.splitlines() if line.strip() and not line.rstrip().endswith(":")]


def test_the_tree_holds_every_command_group():
    names = {" ".join(path) for path, _ in LEAVES}
    assert len(LEAVES) >= 38
    for name in ("dz train", "dz data record libero", "dz eval libero", "dz pipeline run", "dz pipeline gc",
                 "dz promote", "dz track", "dz deploy", "dz stage", "dz bench serve"):
        assert name in names


@pytest.mark.parametrize("path, parser", [(p, q) for p, q, _ in COMMANDS], ids=_name)
def test_every_option_has_help(path, parser):
    missing = [a.option_strings or a.dest for a in parser._actions
               if not isinstance(a, argparse._SubParsersAction) and a.dest != "help" and not (a.help or "").strip()]
    assert missing == []


@pytest.mark.parametrize("path, parser", [(p, q) for p, q, _ in COMMANDS], ids=_name)
def test_help_formats(path, parser):
    text = parser.format_help()  # a stray % in a help string raises here
    assert "default: None" not in text and "default: False" not in text


@pytest.mark.parametrize("path, parser", LEAVES, ids=_name)
def test_every_command_ends_with_an_example_of_itself(path, parser):
    assert parser.epilog and "example" in parser.epilog
    lines = _example_lines(parser.epilog)
    assert lines
    command = " ".join(path)
    for line in lines:
        assert line.startswith("dz ")
        assert line == command or line.startswith(command + " "), f"{line!r} is not an example of {command!r}"
        argv = shlex.split(line)[1:]
        ns = build_parser().parse_args(argv)  # an unknown flag or a bad value exits
        assert ns.func is not None
    assert parser.format_help().rstrip().endswith(lines[-1])


def _help_of(path: tuple[str, ...]) -> str:
    parser = dict((p, q) for p, q, _ in COMMANDS)[path]
    return " ".join(parser.format_help().split())


def test_defaults_are_shown_once():
    gc = _help_of(("dz", "pipeline", "gc"))
    assert "(and `latest`) (default: 10)" in gc
    assert "remove nothing (default" not in gc and "list what would go; remove nothing" in gc  # a flag: no default
    assert _help_of(("dz", "data", "record", "libero")).count("(default: 0.02)") == 1
    # a help text that already names its default keeps its own words, once
    params = _help_of(("dz", "params", "show"))
    assert params.count("params.yaml") >= 1 and "(default params.yaml) (default" not in params
    embodiment = _help_of(("dz", "embodiment", "init"))
    assert embodiment.count("default tiny") == 1 and "(default: tiny)" not in embodiment
