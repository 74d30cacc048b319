"""What the `dz` subcommands of every package share: exit codes, the one-line user error, the help layout (defaults
shown, examples kept as written), claiming --out, and parsers of list arguments."""

from __future__ import annotations

import argparse

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class CLIError(Exception):
    """A user error: printed as one line, exit code 2."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each option's help ends with its default, when it has one worth showing (not None, not a flag's False, not
    empty) and the help text does not already say it; descriptions and epilogs (the examples) keep their lines."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (default is None or default is False or default is argparse.SUPPRESS or default in ("", [], ())
                or "default" in text.lower()):
            return text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return f"{text} (default: %(default)s)" if text else "default: %(default)s"
        return text


class ArgumentParser(argparse.ArgumentParser):
    """`dz`'s parser: the help layout above. Subcommands made with add_subparsers().add_parser() are of the same
    class, so every command of the tree gets it."""

    def __init__(self, *args, formatter_class=HelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)


def example(*lines: str) -> str:
    """A command's epilog: one or more command lines under `example:`."""
    return ("examples:" if len(lines) > 1 else "example:") + "".join(f"\n  {line}" for line in lines)


def claim_out(ns: argparse.Namespace, command: str) -> None:
    """--out as a directory of this command's (absent, empty, or written by dz; --overwrite: any directory)."""
    from .outputs import claim_dir

    claim_dir(ns.out, command, overwrite=ns.overwrite)


def int_list(text: str | None, flag: str) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CLIError(f"{flag} must be comma-separated integers, got {text!r}") from None



def row_printer(out: str | None):
    """A progress callback for benchmarks that report row by row: each row printed as one JSON line, and appended
    to `out` when given."""
    import json

    def emit(row: dict) -> None:
        print(json.dumps(row), flush=True)
        if out:
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")

    return emit


def latent_hw_arg(text: str) -> tuple[int, int]:
    try:
        hw = tuple(int(x) for x in text.split(","))
    except ValueError:
        hw = ()
    if len(hw) != 2 or min(hw) < 1:
        raise CLIError(f"--latent-hw must be H,W (e.g. 11,20), got {text!r}")
    return hw
