"""Typed dataclass schemas from plain mappings (YAML, JSON): unknown keys, wrong types and out-of-range values
become one `SchemaError` that names each bad field by its dotted path.

A field's range sits in its metadata: `field(default=1, metadata={"min": 1})`, `{"gt": 0}`, `{"max": 1}`,
`{"lt": 1}`, `{"choices": (...)}`. Nested dataclasses, `list[X]`, `dict[str, X]`, `tuple[X, ...]`, `X | None`
and `Literal[...]` are checked recursively. Only the standard library is used (the GPU image has no pydantic).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, Union

_NONE = type(None)


class SchemaError(ValueError):
    """Every problem found in one mapping, one per line, each led by the field's dotted path."""

    def __init__(self, problems: list[str], source: str = ""):
        self.problems = problems
        head = f"{source}: " if source else ""
        if len(problems) == 1:
            super().__init__(head + problems[0])
        else:
            super().__init__(head + f"{len(problems)} problems:\n  " + "\n  ".join(problems))


def _type_name(tp: Any) -> str:
    if tp is _NONE:
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is tuple:
        return "a list"
    if origin is dict:
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, getattr(tp, "__name__", str(tp)))


def _convert(value: Any, tp: Any, path: str, problems: list[str]) -> Any:
    """`value` checked against `tp` (problems appended); returns the converted value."""
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a mapping, got {_show(value)}")
            return value
        return _build(tp, value, path, problems)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and _NONE in args:
            return None
        options = [a for a in args if a is not _NONE]
        for option in options:  # the first option that takes the value without a problem
            trial: list[str] = []
            out = _convert(value, option, path, trial)
            if not trial:
                return out
        if len(options) == 1:
            return _convert(value, options[0], path, problems)
        problems.append(f"{path}: expected {_type_name(tp)}, got {_show(value)}")
        return value
    if origin is Literal:
        if value not in args:
            problems.append(f"{path}: must be {_type_name(tp)}, got {_show(value)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            problems.append(f"{path}: expected {_type_name(tp)}, got {_show(value)}")
            return value
        return [_convert(v, args[0], f"{path}[{i}]", problems) for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            problems.append(f"{path}: expected a list, got {_show(value)}")
            return value
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(v, args[0], f"{path}[{i}]", problems) for i, v in enumerate(value))
        if len(value) != len(args):
            problems.append(f"{path}: expected a list of {len(args)} values, got {len(value)}")
            return value
        return tuple(_convert(v, a, f"{path}[{i}]", problems) for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict:
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a mapping, got {_show(value)}")
            return value
        return {str(k): _convert(v, args[1], f"{path}.{k}", problems) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            problems.append(f"{path}: expected true or false, got {_show(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{path}: expected an integer, got {_show(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f"{path}: expected a number, got {_show(value)}")
            return value
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            problems.append(f"{path}: expected a string, got {_show(value)}")
        return value
    return value


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}" if not isinstance(value, (dict, list)) else type(value).__name__


def _check_range(value: Any, meta: dict, path: str, problems: list[str]) -> None:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return
    if "choices" in meta and value not in meta["choices"]:
        problems.append(f"{path}: must be one of {', '.join(repr(c) for c in meta['choices'])}, got {value!r}")
    if isinstance(value, str):
        return
    for key, ok, word in (("min", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
                          ("max", lambda v, b: v <= b, "<="), ("lt", lambda v, b: v < b, "<")):
        if key in meta and not ok(value, meta[key]):
            problems.append(f"{path}: must be {word} {meta[key]}, got {value}")


def _build(cls: type, data: dict, path: str, problems: list[str]):
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    prefix = f"{path}." if path else ""
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            near = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else f" (known: {', '.join(fields)})"
            problems.append(f"{prefix}{key}: unknown key{hint}")
            continue
        before = len(problems)
        converted = _convert(value, hints[key], prefix + key, problems)
        if len(problems) == before:
            _check_range(converted, dict(fields[key].metadata), prefix + key, problems)
        kwargs[key] = converted
    missing = [n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    problems.extend(f"{prefix}{n}: required" for n in missing)
    if len(problems):
        return None
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:  # the dataclass's own cross-field checks
        message, last = str(exc), path.rsplit(".", 1)[-1]
        if path and message.startswith(last + "."):  # "train.lr must be ..." under "profiles.demo.train"
            message = path[: len(path) - len(last)] + message
        elif path and not message.startswith(path):
            message = f"{path}: {message}"
        problems.append(message)
        return None


def build(cls: type, data: Any, path: str = "", source: str = ""):
    """An instance of dataclass `cls` from mapping `data`; raises SchemaError listing every problem.
    `path` prefixes field names in messages (e.g. 'profiles.demo.train'); `source` names the file."""
    problems: list[str] = []
    if not isinstance(data, dict):
        raise SchemaError([f"{path or 'top level'}: expected a mapping, got {_show(data)}"], source)
    out = _build(cls, data, path, problems)
    if problems:
        raise SchemaError(problems, source)
    return out
