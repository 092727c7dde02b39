"""Typed parsing of JSON values: the one checker behind config.json, presets and manifest.json.

    parse_dataclass(BuildConfig, data, where="manifest.json", field="build")     -> BuildConfig
    parse_fields(data, {"hidden_size": Field(int, positive=True)}, "config.json") -> {"hidden_size": 96}

A JSON value is checked against a type annotation:

    int             an integer: not a bool, not 2.7 (nor 2.0)
    float           a finite number; integers are accepted and converted
    bool, str       true or false; a string
    X | None        null or an X (unions of several types try each in turn)
    tuple[T, ...]   an array of T, returned as a tuple (list[T]: returned as a list)
    tuple[A, B]     an array of exactly an A and a B, returned as a tuple
    dict[str, T]    an object whose values are T
    Any             anything
    a dataclass     an object holding its fields: a missing required field or an unknown key is an error

Every problem raises `ConfigError` naming the file and the field path, e.g.
`config.json: num_hidden_layers must be an integer, not 2.7`.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuron_infer.errors import ConfigError, NeuronInferError


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()


@dataclass(frozen=True)
class Field:
    """One key of a JSON object read by `parse_fields`: its type, its default (or REQUIRED) and a sign bound
    that applies to every number in the value (e.g. each id of a list of token ids)."""

    type: Any
    default: Any = REQUIRED
    positive: bool = False
    nonnegative: bool = False


def show(value: Any) -> str:
    """A value as it appears in the JSON file, shortened."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _describe(tp: Any) -> str:
    if tp is Any:
        return "anything"
    if tp is type(None):
        return "null"
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a finite number"
    if tp is str:
        return "a string"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is tuple and _fixed(args):
        return f"an array of {len(args)}: " + ", ".join(_describe(a) for a in args)
    if origin in (tuple, list):
        return f"an array of {_plural(args[0])}"
    return "a JSON object"


def _fixed(args: tuple) -> bool:
    """A fixed-length tuple annotation (tuple[A, B]), not tuple[T, ...]."""
    return len(args) != 2 or args[1] is not Ellipsis


def _plural(tp: Any) -> str:
    return {int: "integers", float: "numbers", str: "strings", bool: "booleans"}.get(tp, "values")


def _fail(where: str, field: str, tp: Any, value: Any) -> ConfigError:
    return ConfigError(f"{where}: {field} must be {_describe(tp)}, not {show(value)}")


def check(value: Any, tp: Any, field: str, where: str) -> Any:
    """`value` checked against the annotation `tp` (see the module docstring); tuples and dataclasses built."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        return _check_union(value, tp, args, field, where)
    if tp in (bool, int, float, str, type(None)):
        return _check_scalar(value, tp, field, where)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)) or (origin is tuple and _fixed(args) and len(value) != len(args)):
            raise _fail(where, field, tp, value)
        if origin is tuple and _fixed(args):
            return tuple(check(v, t, f"{field}[{i}]", where) for i, (v, t) in enumerate(zip(value, args)))
        items = [check(v, args[0], f"{field}[{i}]", where) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise _fail(where, field, tp, value)
        vt = args[1] if args else Any
        return {_key(k, field, where): check(v, vt, f"{field}.{k}", where) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return parse_dataclass(tp, value, where, field)
    raise TypeError(f"typed.check: unsupported annotation {tp!r}")  # a programming error, not bad input


def _check_union(value: Any, tp: Any, args: tuple, field: str, where: str) -> Any:
    if value is None and type(None) in args:
        return None
    others = [a for a in args if a is not type(None)]
    if len(others) == 1:  # X | None: X's own (more precise) message
        if value is None:
            raise _fail(where, field, tp, value)
        return check(value, others[0], field, where)
    for alt in others:
        try:
            return check(value, alt, field, where)
        except ConfigError:
            continue
    raise _fail(where, field, tp, value)


def _check_scalar(value: Any, tp: type, field: str, where: str) -> Any:
    if tp is type(None):
        ok = value is None
    elif tp is bool:
        ok = isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        value = float(value) if ok else value
    else:  # int, str: bool is a subclass of int but never an integer here
        ok = isinstance(value, tp) and not isinstance(value, bool)
    if not ok:
        raise _fail(where, field, tp, value)
    return value


def _key(k: Any, field: str, where: str) -> str:
    if not isinstance(k, str):
        raise ConfigError(f"{where}: the keys of {field} must be strings, not {show(k)}")
    return k


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def parse_dataclass(cls: type, data: Any, where: str, field: str = "") -> Any:
    """A `cls` instance from a JSON object; the constructor's own `ConfigError`s get `where` and `field` added."""
    if isinstance(data, cls):
        return data
    what = field or "the top level"
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: {what} must be a JSON object {{...}}, not {show(data)}")
    fields = [f for f in dataclasses.fields(cls) if f.init]
    names = [f.name for f in fields]
    unknown = sorted(str(k) for k in set(data) - set(names))
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {unknown} in {what}; valid keys are {sorted(names)}. "
            "Remove or rename them (is the file from another neuron-infer version?)"
        )
    hints, kwargs = _hints(cls), {}
    for f in fields:
        sub = f"{field}.{f.name}" if field else f.name
        if f.name in data:
            kwargs[f.name] = check(data[f.name], hints[f.name], sub, where)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{where}: required key {sub!r} is missing")
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{where}: {field + ': ' if field else ''}{e}") from e


def parse_fields(data: Any, spec: Mapping[str, Field], where: str, field: str = "",
                 missing_hint: str = "") -> dict[str, Any]:
    """The keys of `spec` read from the JSON object `data` (defaults filled in); other keys are left to the caller."""
    what = field or "the top level"
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: {what} must be a JSON object {{...}}, not {show(data)}")
    out = {}
    for key, f in spec.items():
        sub = f"{field}.{key}" if field else key
        if key not in data:
            if f.default is REQUIRED:
                raise ConfigError(f"{where}: required key {sub!r} is missing{missing_hint}")
            out[key] = f.default
            continue
        out[key] = check(data[key], f.type, sub, where)
        if f.positive or f.nonnegative:
            _check_sign(out[key], f, sub, where)
    return out


def _check_sign(value: Any, f: Field, field: str, where: str) -> None:
    numbers = value if isinstance(value, (tuple, list)) else (value,)
    for v in numbers:
        if isinstance(v, (int, float)) and not isinstance(v, bool) and (v <= 0 if f.positive else v < 0):
            kind = "positive" if f.positive else "non-negative"
            raise ConfigError(f"{where}: {field} must be {kind}, not {show(value)}")


MAX_JSON_BYTES = 1 << 26  # 64 MiB: far above any config, index, header or manifest
MAX_JSON_DEPTH = 64  # nesting levels
MAX_INT_DIGITS = 24  # digits of one integer (an int64 has at most 19)


class JsonLimitError(ValueError):
    """JSON past one of the bounds of `parse_json` (a ValueError, as json.JSONDecodeError is)."""


def parse_json(raw: bytes | str) -> Any:
    """json.loads under bounds: at most MAX_JSON_BYTES, MAX_JSON_DEPTH levels and MAX_INT_DIGITS digits per
    integer, and no key twice in one object; past one, JsonLimitError (a ValueError) says which."""
    if len(raw) > MAX_JSON_BYTES:
        raise JsonLimitError(f"it is larger than {MAX_JSON_BYTES} bytes")
    if isinstance(raw, bytes | bytearray) and raw.startswith(b"\xef\xbb\xbf"):
        raise JsonLimitError("it starts with a UTF-8 byte order mark (BOM); save it as UTF-8 without a BOM")
    try:
        value = json.loads(raw, parse_int=_bounded_int, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise JsonLimitError(f"it nests more than {MAX_JSON_DEPTH} levels deep") from None
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise JsonLimitError(f"it nests more than {MAX_JSON_DEPTH} levels deep")
            stack += [(x, depth + 1) for x in (v.values() if isinstance(v, dict) else v)]
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object whose keys are all different: JSON readers disagree on which of two equal keys counts (Python keeps
    the last, others the first), so a file that says two things is refused instead of read one way."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise JsonLimitError(f"it holds the key {twice!r} twice in one object")
    return out


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise JsonLimitError(f"it holds an integer of {len(text.lstrip('-'))} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def read_json(path: Path, fix: str, error: type[NeuronInferError] = ConfigError) -> Any:
    """The parsed JSON of an existing file; unreadable, non-UTF-8, invalid or unbounded JSON (see `parse_json`)
    raises `error` ending in `fix`."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise error(f"cannot read {path}: {e.strerror or e}; {fix}") from e
    return json_from_bytes(raw, path, fix, error)


def json_from_bytes(raw: bytes, path: Path | str, fix: str, error: type[NeuronInferError] = ConfigError) -> Any:
    """`read_json` of bytes already read from `path` (e.g. the verified bytes of an artifact file)."""
    try:
        return parse_json(raw)
    except JsonLimitError as e:
        raise error(f"{path} is not usable JSON: {e}; {fix}") from e
    except UnicodeDecodeError as e:
        raise error(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); {fix}") from e
    except json.JSONDecodeError as e:
        raise error(f"{path} is not valid JSON ({e}); {fix}") from e
