"""Typed dataclass schemas from plain mappings (YAML, JSON): unknown keys, wrong types and out-of-range values
become one `SchemaError` that names each bad field by its dotted path.

A field's range sits in its metadata: `field(default=1, metadata={"min": 1})`, `{"gt": 0}`, `{"max": 1}`,
`{"lt": 1}`, `{"choices": (...)}`, `{"plain_name": True}` (a name that may become part of a path),
`{"checked_by": "..."}` (a mapping whose values another schema checks). A range on a list or tuple field applies to
each element. Nested dataclasses, `list[X]`, `dict[str, X]`, `tuple[X, ...]`, `X | None` and `Literal[...]` are
checked recursively. Every number must be finite (YAML's .nan and .inf are refused, also inside free-form `Any`
values) and every integer must fit 64 bits. Only the standard library is used (the GPU image has no pydantic).

Values may share parts (YAML aliases): a shared list or mapping is checked once per type, and a message shows at
most a short, truncated rendering of a value (`bounded_repr`), never the whole of it. `load_yaml` is the one YAML
loader for what users write (params.yaml, `--set` values, embodiment files, robot configs): PyYAML's safe loader
with a cap on a document's size, aliases, nodes and nesting and on a number's written length, no recursive
aliases, no sexagesimal numbers (`1:30`), and optionally no aliases at all.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import re
import reprlib
import types
import typing
from typing import Any, Literal, Union

_NONE = type(None)
INT64_MAX = 2**63 - 1
# Names that end up in paths, registry entries and tarball names: no separators, no '..', no leading dot.
PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,99}")
PLAIN_NAME_RULE = ("a plain name (letters, digits, '.', '_', '-', '+'; starting with a letter or digit; at most "
                   "100 characters; no '/', '\\' or '..')")


SEED = {"min": 0, "max": 2**32 - 1}  # a seed field's range: numpy's legacy seeding takes 32 bits


class SchemaError(ValueError):
    """Every problem found in one mapping, one per line, each led by the field's dotted path."""

    SHOWN = 20  # the message lists this many problems, then counts the rest

    def __init__(self, problems: list[str], source: str = ""):
        self.problems = problems
        head = f"{source}: " if source else ""
        if len(problems) == 1:
            super().__init__(head + problems[0])
        else:
            more = [f"... and {len(problems) - self.SHOWN} more"] if len(problems) > self.SHOWN else []
            super().__init__(head + f"{len(problems)} problems:\n  " + "\n  ".join(problems[: self.SHOWN] + more))


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


def _convert(value: Any, tp: Any, path: str, problems: list[str], meta: dict | None = None,
             memo: dict | None = None) -> Any:
    """`value` checked against `tp` (problems appended); returns the converted value. `meta` (the field's range)
    only words the message for a number that is not finite. `memo` holds the containers already converted, by
    (id, type): a list or mapping shared by aliases is checked once (its problems named at its first path)."""
    if not isinstance(value, (list, tuple, dict)):
        return _convert_one(value, tp, path, problems, meta, memo)
    memo = {} if memo is None else memo
    try:
        key = (id(value), tp)
        if key in memo:
            return memo[key][1]
    except TypeError:  # an unhashable type annotation: no memo
        return _convert_one(value, tp, path, problems, meta, memo)
    memo[key] = (value, value)  # a value that contains itself is not walked again
    out = _convert_one(value, tp, path, problems, meta, memo)
    memo[key] = (value, out)  # the value is kept alive so that its id is not reused
    return out


def _convert_one(value: Any, tp: Any, path: str, problems: list[str], meta: dict | None, memo: dict | None) -> Any:
    if tp is Any:
        _check_finite_tree(value, path, problems)
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a mapping, got {_show(value)}")
            return value
        return _build(tp, value, path, problems, memo)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and _NONE in args:
            return None
        options = [a for a in args if a is not _NONE]
        for option in options:  # the first option that takes the value without a problem
            trial: list[str] = []
            out = _convert(value, option, path, trial, meta, {})
            if not trial:
                return out
        if len(options) == 1:
            return _convert(value, options[0], path, problems, meta, memo)
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
        return _elements(value, lambda i, v, found: _convert(v, args[0], f"{path}[{i}]", found, meta, memo),
                         problems, list)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            problems.append(f"{path}: expected a list, got {_show(value)}")
            return value
        if len(args) == 2 and args[1] is Ellipsis:
            return _elements(value, lambda i, v, found: _convert(v, args[0], f"{path}[{i}]", found, meta, memo),
                             problems, tuple)
        if len(value) != len(args):
            problems.append(f"{path}: expected a list of {len(args)} values, got {len(value)}")
            return value
        return tuple(_convert(v, a, f"{path}[{i}]", problems, meta, memo)
                     for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict:
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a mapping, got {_show(value)}")
            return value
        return {str(k): _convert(v, args[1], f"{path}.{_key(k)}", problems, None, memo) for k, v in value.items()}
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


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict, _REPR.maxset = 3, 6, 6, 6, 6
_REPR.maxstring, _REPR.maxlong, _REPR.maxother = 60, 40, 60


def bounded_repr(value: Any, limit: int = 120) -> str:
    """repr() of `value` cut short: at most a few items of a few levels and `limit` characters, however large or
    shared (YAML aliases) the value is."""
    try:
        text = _REPR.repr(value)
    except Exception:  # noqa: BLE001 - a value whose repr fails is named by its type
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _key(key: Any) -> str:
    """A mapping key inside a dotted path."""
    return key if isinstance(key, str) and len(key) <= 100 else bounded_repr(key, 60)


def _elements(value: list | tuple, convert, problems: list[str], kind: type):
    """Each element converted by `convert(index, element, problems)`; a list whose elements have several problems
    is one problem: the first, and how many more (a long list of the wrong things stays one line)."""
    found: list[str] = []
    out = kind(convert(i, v, found) for i, v in enumerate(value))
    if len(found) > 1:
        found = [f"{found[0]} (and {len(found) - 1} more problems in its other elements)"]
    problems.extend(found)
    return out


def _show(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return type(value).__name__
    return f"{type(value).__name__} {bounded_repr(value, 60)}"


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
            _check_finite_tree(v, f"{path}.{_key(k)}" if isinstance(value, dict) else f"{path}[{k}]", problems, seen)


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
    return f"must be {PLAIN_NAME_RULE}, got {bounded_repr(value)}"


def _check_range(value: Any, meta: dict, path: str, problems: list[str], seen: set[int] | None = None) -> None:
    if isinstance(value, (list, tuple)):  # a range on a list field bounds each element; a shared list once
        seen = set() if seen is None else seen
        if id(value) in seen:
            return
        seen.add(id(value))
        for i, v in enumerate(value):
            _check_range(v, meta, f"{path}[{i}]", problems, seen)
        return
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return
    if "choices" in meta and value not in meta["choices"]:
        problems.append(f"{path}: must be one of {', '.join(repr(c) for c in meta['choices'])}, "
                        f"got {bounded_repr(value)}")
    if isinstance(value, str):
        if meta.get("plain_name") and (problem := plain_name_problem(value)):
            problems.append(f"{path}: {problem}")
        return
    if any(key in meta and not within(value, meta[key]) for key, within in _WITHIN.items()):
        problems.append(f"{path}: must be {_range_text(meta)}, got {value}")


def _build(cls: type, data: dict, path: str, problems: list[str], memo: dict | None = None):
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    prefix = f"{path}." if path else ""
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            near = difflib.get_close_matches(_key(key), list(fields), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else f" (known: {', '.join(fields)})"
            problems.append(f"{prefix}{_key(key)}: unknown key{hint}")
            continue
        before = len(problems)
        meta = dict(fields[key].metadata)
        if "checked_by" in meta:  # another schema checks the values; here it is only a mapping
            if not isinstance(value, dict):
                problems.append(f"{prefix}{key}: expected a mapping, got {_show(value)}")
            kwargs[key] = value
            continue
        converted = _convert(value, hints[key], prefix + key, problems, meta, memo)
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
    out = _build(cls, data, path, problems, {})
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


# --- YAML ---------------------------------------------------------------------------------------------------------

# What one YAML document may hold: a params.yaml, an embodiment file or a robot config has a few hundred to a few
# thousand nodes, a handful of aliases (`<<: *base` merges) and a nesting of under ten levels.
MAX_YAML_NODES = 50_000
MAX_YAML_ALIASES = 1_000
MAX_YAML_DEPTH = 64
# A document's size (params.yaml is about 35 KB): PyYAML's pure-Python scanner costs about a second per MB.
MAX_YAML_BYTES = 1024 * 1024
# A number's written length: YAML builds a long integer (and a sexagesimal one, `1:59:59`, by one big-integer
# multiply per part: quadratic time) before anything can check its value.
MAX_YAML_NUMBER_CHARS = 100
LINE_BREAKS = "\r\n\x85\u2028\u2029"  # what PyYAML's reader counts as the end of a line
# YAML 1.2 numbers: PyYAML (YAML 1.1) reads 1e-5 as a string; DVC's ruamel reads it as a float.
YAML12_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*)\.?[0-9_]*(?:[eE][-+]?[0-9]+)$|^[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?$")


@functools.cache
def _yaml_classes() -> tuple[type, dict[tuple[bool, bool], type]]:
    """The limit error (a yaml.YAMLError) and the bounded SafeLoader classes by (yaml12_numbers, aliases); built on
    first use, so that importing this module does not need PyYAML."""
    import yaml

    class YAMLLimitError(yaml.YAMLError):
        """A document past one of the limits: one line, with where in the text."""

    def refuse(event, what: str) -> YAMLLimitError:
        mark = getattr(event, "start_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        return YAMLLimitError(where + what)

    class BoundedLoader(yaml.SafeLoader):
        """PyYAML's SafeLoader (aliases stay shared: the loaded value is never expanded) that refuses a document of
        more than MAX_YAML_NODES nodes, MAX_YAML_ALIASES aliases or MAX_YAML_DEPTH levels, and an alias inside the
        value it names (a value that contains itself)."""

        allow_aliases = True

        def __init__(self, stream):
            super().__init__(stream)
            self.start_counts()

        def start_counts(self) -> None:
            self.counted_nodes = self.counted_aliases = self.depth = 0
            self.open_anchors: set[str] = set()

        def forward(self, length=1):
            """PyYAML's Reader.forward (a loop in Python per character) done by slicing for a run of text on one
            line: a long plain scalar is passed over in one step. Same position, line and column."""
            chunk = self.buffer[self.pointer:self.pointer + length]
            if self.raw_buffer is not None or len(chunk) != length or any(c in chunk for c in LINE_BREAKS):
                return super().forward(length)
            self.pointer += length
            self.index += length
            self.column += length - chunk.count("\ufeff")

        def compose_node(self, parent, index):
            event = self.peek_event()
            if isinstance(event, yaml.AliasEvent):
                if not self.allow_aliases:
                    raise refuse(event, "anchors and aliases (&name, *name) are not accepted here")
                self.counted_aliases += 1
                if self.counted_aliases > MAX_YAML_ALIASES:
                    raise refuse(event, f"more than {MAX_YAML_ALIASES} aliases in one document")
                if event.anchor in self.open_anchors:
                    raise refuse(event, f"alias *{event.anchor} refers to itself (a value that contains itself)")
                return super().compose_node(parent, index)
            anchor = getattr(event, "anchor", None)
            if anchor is not None and not self.allow_aliases:
                raise refuse(event, "anchors and aliases (&name, *name) are not accepted here")
            self.counted_nodes += 1
            if self.counted_nodes > MAX_YAML_NODES:
                raise refuse(event, f"more than {MAX_YAML_NODES} values in one document")
            if self.depth >= MAX_YAML_DEPTH:
                raise refuse(event, f"nested deeper than {MAX_YAML_DEPTH} levels")
            self.depth += 1
            if anchor is not None:
                self.open_anchors.add(anchor)
            try:
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1
                self.open_anchors.discard(anchor)

        def flatten_mapping(self, node):
            """PyYAML's merge (`<<: *base`) copies the keys of each merged mapping into the one that merges it: a
            chain of merges, each adding a key to the one before, copies a quadratic number of keys from a short
            document. Each copied key counts as a value of the document (MAX_YAML_NODES), counted before it is
            copied."""
            for key_node, value_node in node.value:
                if key_node.tag != "tag:yaml.org,2002:merge":
                    continue
                merged = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
                for sub in merged:
                    if not isinstance(sub, yaml.MappingNode):
                        continue  # PyYAML refuses it
                    self.flatten_mapping(sub)
                    self.counted_nodes += len(sub.value)
                    if self.counted_nodes > MAX_YAML_NODES:
                        raise refuse(node, f"more than {MAX_YAML_NODES} values in one document, counting the keys "
                                           "that merges (<<) copy")
            super().flatten_mapping(node)

    def checked_number(construct):
        """`construct` (PyYAML's int or float builder) for a number of at most MAX_YAML_NUMBER_CHARS characters,
        written in decimal, hex, octal or binary: a sexagesimal one (`1:30`, YAML 1.1's 90) is refused."""

        def build(loader, node):
            text = node.value if isinstance(node.value, str) else ""
            if ":" in text:
                raise refuse(node, f"{bounded_repr(text, 40)}: sexagesimal numbers (1:30 for 90) are not accepted; "
                                   "write the number plainly, or quote it for a string")
            if len(text) > MAX_YAML_NUMBER_CHARS:
                raise refuse(node, f"a number written with {len(text):,} characters (at most "
                                   f"{MAX_YAML_NUMBER_CHARS} characters are read)")
            return construct(loader, node)

        return build

    BoundedLoader.add_constructor("tag:yaml.org,2002:int", checked_number(yaml.SafeLoader.construct_yaml_int))
    BoundedLoader.add_constructor("tag:yaml.org,2002:float", checked_number(yaml.SafeLoader.construct_yaml_float))

    base = BoundedLoader
    if yaml.__with_libyaml__:
        from yaml._yaml import CParser
        from yaml.composer import Composer
        from yaml.constructor import SafeConstructor
        from yaml.resolver import Resolver

        class LibyamlBoundedLoader(CParser, BoundedLoader):
            """BoundedLoader whose text is scanned and parsed by libyaml (C; PyYAML's own scanner takes about a
            second per 10,000 values); the nodes are still composed, counted and built by BoundedLoader."""

            def __init__(self, stream):
                CParser.__init__(self, stream)
                Composer.__init__(self)
                SafeConstructor.__init__(self)
                Resolver.__init__(self)
                self.start_counts()

            # CParser composes nodes in C, past the limits: the nodes come from PyYAML's composer instead
            get_single_node, get_node, check_node = Composer.get_single_node, Composer.get_node, Composer.check_node

        base = LibyamlBoundedLoader

    loaders: dict[tuple[bool, bool], type] = {}
    for yaml12 in (False, True):
        for aliases in (True, False):
            cls = type(f"BoundedLoader{'12' if yaml12 else ''}{'' if aliases else 'NoAliases'}", (base,),
                       {"allow_aliases": aliases})
            if yaml12:
                cls.add_implicit_resolver("tag:yaml.org,2002:float", YAML12_FLOAT, list("-+0123456789."))
            loaders[(yaml12, aliases)] = cls
    return YAMLLimitError, loaders


def _size(n: int) -> str:
    return f"{n // 1024 // 1024} MiB" if n % (1024 * 1024) == 0 else f"{n:,} bytes"


def _capped_text(source: str | os.PathLike, max_bytes: int | None, limit_error: type) -> str:
    """The text of `source` (a string, or a file read as UTF-8) if it holds at most `max_bytes` bytes."""
    over = f"the document is larger than the {_size(max_bytes)} a YAML document may hold" \
        if max_bytes is not None else ""
    if not isinstance(source, str):
        with open(source, "rb") as f:
            data = f.read() if max_bytes is None else f.read(max_bytes + 1)
        if max_bytes is not None and len(data) > max_bytes:
            raise limit_error(over)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise limit_error(f"not UTF-8 text (byte {exc.start:,})") from None
    if max_bytes is not None and (len(source) > max_bytes or
                                  len(source.encode("utf-8", "surrogatepass")) > max_bytes):
        raise limit_error(over)
    return source


def load_yaml(source: str | os.PathLike, *, yaml12_numbers: bool = False, aliases: bool = True,
              max_bytes: int | None = MAX_YAML_BYTES) -> Any:
    """The document in `source` (its text, or a path to read), by PyYAML's safe loader within the limits above;
    a document over `max_bytes` bytes (1 MiB unless told; None: no cap) is refused before it is scanned, a file
    only read that far. `yaml12_numbers` reads 1e-5 as a number (YAML 1.2, as DVC does); `aliases=False` refuses
    anchors and aliases (a one-line `--set` value needs none). Raises yaml.YAMLError: a syntax error, a limit
    (a number longer than MAX_YAML_NUMBER_CHARS characters, a sexagesimal number), or a value YAML cannot build
    (the 13th month); a limit's message is one line, with the line and column where it applies.
    OSError: a path that cannot be read."""
    import yaml

    limit_error, loaders = _yaml_classes()
    text = _capped_text(source, max_bytes, limit_error)
    try:
        return yaml.load(text, Loader=loaders[(bool(yaml12_numbers), bool(aliases))])  # noqa: S506 - a SafeLoader
    except RecursionError:
        raise limit_error("nested too deeply") from None
    except yaml.MarkedYAMLError as exc:  # libyaml's own cap on nesting (1,000 levels), worded as ours
        if "maximum nesting depth" not in str(exc.problem):
            raise
        mark = exc.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise limit_error(f"{where}nested deeper than {MAX_YAML_DEPTH} levels") from None
    except (ValueError, OverflowError, TypeError) as exc:  # raised while building a scalar
        raise limit_error(f"a value YAML cannot build: {(str(exc).splitlines() or [''])[0][:200]}") from None
