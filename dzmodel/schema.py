"""Typed dataclass schemas from plain mappings (YAML, JSON): unknown keys, wrong types and out-of-range values
become one `SchemaError` that names each bad field by its dotted path.

A field's range sits in its metadata: `field(default=1, metadata={"min": 1})`, `{"gt": 0}`, `{"max": 1}`,
`{"lt": 1}`, `{"choices": (...)}`, `{"plain_name": True}` (a name that may become part of a path),
`{"checked_by": "..."}` (a mapping whose values another schema checks). A range on a list or tuple field applies to
each element. Nested dataclasses, `list[X]`, `dict[str, X]`, `tuple[X, ...]`, `X | None` and `Literal[...]` are
checked recursively. Every number must be finite (YAML's .nan and .inf are refused, also inside free-form `Any`
values) and every integer must fit 64 bits. Only the standard library is used (the GPU image has no pydantic).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from typing import Any, Literal, Union

_NONE = type(None)
INT64_MAX = 2**63 - 1
# Names that end up in paths, registry entries and tarball names: no separators, no '..', no leading dot.
PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,99}")
PLAIN_NAME_RULE = ("a plain name (letters, digits, '.', '_', '-', '+'; starting with a letter or digit; at most "
                   "100 characters; no '/', '\\' or '..')")


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


def _convert(value: Any, tp: Any, path: str, problems: list[str], meta: dict | None = None) -> Any:
    """`value` checked against `tp` (problems appended); returns the converted value. `meta` (the field's range)
    only words the message for a number that is not finite."""
    if tp is Any:
        _check_finite_tree(value, path, problems)
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
            out = _convert(value, option, path, trial, meta)
            if not trial:
                return out
        if len(options) == 1:
            return _convert(value, options[0], path, problems, meta)
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
        return [_convert(v, args[0], f"{path}[{i}]", problems, meta) for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            problems.append(f"{path}: expected a list, got {_show(value)}")
            return value
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(v, args[0], f"{path}[{i}]", problems, meta) for i, v in enumerate(value))
        if len(value) != len(args):
            problems.append(f"{path}: expected a list of {len(args)} values, got {len(value)}")
            return value
        return tuple(_convert(v, a, f"{path}[{i}]", problems, meta) for i, (v, a) in enumerate(zip(value, args)))
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
        elif abs(value) > INT64_MAX:
            bounded = meta and ("max" in meta or "lt" in meta)
            text = _range_text(meta) if bounded else "an integer that fits 64 bits"
            problems.append(f"{path}: must be {text}, got {value}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f"{path}: expected a number, got {_show(value)}")
            return value
        try:
            number = float(value)
        except OverflowError:  # an integer beyond float's range
            number = math.inf
        if not math.isfinite(number):
            text = _range_text(meta)
            problems.append(f"{path}: must be a finite number{' ' + text if text else ''}, got {_show_number(value)}")
            return value
        return number
    if tp is str:
        if not isinstance(value, str):
            problems.append(f"{path}: expected a string, got {_show(value)}")
        return value
    return value


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}" if not isinstance(value, (dict, list)) else type(value).__name__


def _show_number(value: Any) -> str:
    return str(value) if isinstance(value, float) else _show(value)


def _check_finite_tree(value: Any, path: str, problems: list[str], seen: set[int] | None = None) -> None:
    """Free-form values (model overrides, robot fields) hold no NaN or infinity either. Each container is visited
    once: YAML aliases share them, and a nest of aliases would otherwise take exponential time."""
    seen = set() if seen is None else seen
    if isinstance(value, float) and not math.isfinite(value):
        problems.append(f"{path}: must be a finite number, got {value}")
    elif isinstance(value, (dict, list, tuple)) and id(value) not in seen:
        seen.add(id(value))
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            _check_finite_tree(v, f"{path}.{k}" if isinstance(value, dict) else f"{path}[{k}]", problems, seen)


_BOUNDS = (("min", ">=", "["), ("gt", ">", "("), ("max", "<=", "]"), ("lt", "<", ")"))
_WITHIN = {"min": lambda v, b: v >= b, "gt": lambda v, b: v > b, "max": lambda v, b: v <= b, "lt": lambda v, b: v < b}


def _range_text(meta: dict | None) -> str:
    """'>= 1', '> 0', 'in [0, 1)', ... for a field's range metadata; '' when it has none."""
    meta = meta or {}
    low = next(((word, bracket, meta[key]) for key, word, bracket in _BOUNDS[:2] if key in meta), None)
    high = next(((word, bracket, meta[key]) for key, word, bracket in _BOUNDS[2:] if key in meta), None)
    if low and high:
        return f"in {low[1]}{_number(low[2])}, {_number(high[2])}{high[1]}"
    bound = low or high
    return f"{bound[0]} {_number(bound[2])}" if bound else ""


def _number(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else str(bound)


def plain_name_problem(value: str) -> str | None:
    """Why `value` cannot be used as a name inside a path (None: it can)."""
    if PLAIN_NAME.fullmatch(value) and ".." not in value:
        return None
    return f"must be {PLAIN_NAME_RULE}, got {value!r}"


def _check_range(value: Any, meta: dict, path: str, problems: list[str]) -> None:
    if isinstance(value, (list, tuple)):  # a range on a list field bounds each element
        for i, v in enumerate(value):
            _check_range(v, meta, f"{path}[{i}]", problems)
        return
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return
    if "choices" in meta and value not in meta["choices"]:
        problems.append(f"{path}: must be one of {', '.join(repr(c) for c in meta['choices'])}, got {value!r}")
    if isinstance(value, str):
        if meta.get("plain_name") and (problem := plain_name_problem(value)):
            problems.append(f"{path}: {problem}")
        return
    if any(key in meta and not within(value, meta[key]) for key, within in _WITHIN.items()):
        problems.append(f"{path}: must be {_range_text(meta)}, got {value}")


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
        meta = dict(fields[key].metadata)
        if "checked_by" in meta:  # another schema checks the values; here it is only a mapping
            if not isinstance(value, dict):
                problems.append(f"{prefix}{key}: expected a mapping, got {_show(value)}")
            kwargs[key] = value
            continue
        converted = _convert(value, hints[key], prefix + key, problems, meta)
        if len(problems) == before:
            _check_range(converted, meta, prefix + key, problems)
        kwargs[key] = converted
    missing = [n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    problems.extend(f"{prefix}{n}: required" for n in missing)
    if len(problems):
        return None
    try:
        return cls(**kwargs)
    except (ValueError, TypeError, ArithmeticError) as exc:  # the dataclass's own cross-field checks
        message, last = str(exc), path.rsplit(".", 1)[-1]
        if path and message.startswith((last + ".", last + ":")):  # "train.lr ..." under "profiles.demo.train"
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


def field_problems(obj: Any, path: str = "") -> list[str]:
    """The range problems of an already built dataclass (nested ones included): what `build` would refuse. For
    `__post_init__` checks of objects made in code, and for tests."""
    problems: list[str] = []
    prefix = f"{path}." if path else ""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            problems += field_problems(value, prefix + f.name)
            continue
        before = len(problems)
        for i, v in enumerate(value if isinstance(value, (list, tuple)) else [value]):
            where = f"{prefix}{f.name}[{i}]" if isinstance(value, (list, tuple)) else prefix + f.name
            if isinstance(v, float) and not math.isfinite(v):
                text = _range_text(dict(f.metadata))
                problems.append(f"{where}: must be a finite number{' ' + text if text else ''}, got {v}")
        if len(problems) == before:
            _check_range(value, dict(f.metadata), prefix + f.name, problems)
    return problems
