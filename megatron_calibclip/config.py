"""Typed configuration: dataclasses loaded from plain dicts / YAML with errors that name the field.

Why hand-written: we want three things no small library gives together without extra
dependencies: (1) every field documented where it is declared (a comment on the dataclass
field), (2) unknown keys rejected with the list of allowed keys, (3) `Literal[...]` fields
rejected with the list of allowed values. `from_dict` walks nested dataclasses, so one
error message such as ``trainer.fp8.granularity: 'rowise' is not one of ['tensorwise', ...]``
tells the user exactly what to fix.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence, TypeVar, Union, get_args, get_origin

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names the field path."""


def need(ok: bool, path: str, value: Any, rule: str) -> None:
    """One-line ConfigError naming the field, the value and what is allowed (every section's
    per-field check)."""
    if not ok:
        raise ConfigError(f"{path}: {value!r} is invalid; it must be {rule}")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp)


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Convert `value` to type `tp` or raise ConfigError naming `path`."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        allowed = list(get_args(tp))
        if value not in allowed:
            raise ConfigError(f"{path}: {value!r} is not one of {allowed}")
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(f"{path}: {value!r} does not fit {tp}: " + "; ".join(errors))
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping for {_type_name(tp)}, got {value!r}")
        return from_dict(tp, value, path)
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"{path}: expected {len(args)} items, got {len(value)}")
            return tuple(_coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item_t = args[0] if args else Any
        items = [_coerce(v, item_t, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple or tp is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{path}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    if tp is Path:
        return Path(value)
    return value


def from_dict(cls: type[T], data: Mapping[str, Any], path: str = "") -> T:
    """Build dataclass `cls` from a mapping, validating every key and value.

    Unknown keys fail with the allowed keys named; `__post_init__` of the dataclass runs
    afterwards for cross-field checks (it should raise ConfigError too).
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or cls.__name__}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = path or cls.__name__
        raise ConfigError(
            f"{where}: unknown key(s) {unknown}; allowed keys are {sorted(fields)}"
        )
    kwargs = {}
    for name, value in data.items():
        sub = f"{path}.{name}" if path else name
        kwargs[name] = _coerce(value, hints[name], sub)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except TypeError as err:  # missing required field
        raise ConfigError(f"{path or cls.__name__}: {err}") from err


def to_dict(obj: Any) -> Any:
    """Dataclass -> plain dict (YAML/JSON friendly)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def parse_override(text: str) -> tuple[list[str], Any]:
    """'a.b.c=VALUE' -> (['a','b','c'], value parsed as YAML scalar)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.path=value")
    key, raw = text.split("=", 1)
    keys = [k for k in key.strip().split(".") if k]
    if not keys:
        raise ConfigError(f"override {text!r} has an empty key")
    return keys, yaml.safe_load(raw) if raw.strip() else ""


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    """Apply `key.path=value` overrides to a nested dict (validation happens in from_dict)."""
    for text in overrides:
        keys, value = parse_override(text)
        node = data
        for k in keys[:-1]:
            nxt = node.setdefault(k, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {text!r}: {k!r} is not a section")
            node = nxt
        node[keys[-1]] = value
    return data


def load_yaml(path: str | Path) -> dict:
    """Read a YAML mapping, with a clear error for a missing file or a non-mapping document."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.MarkedYAMLError as err:  # file:line:column: what the parser found
        mark = err.problem_mark or err.context_mark
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(p)
        what = " ".join(x for x in (err.context, err.problem) if x)
        raise ConfigError(f"{where}: malformed YAML: {what}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{p}: malformed YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping, got {type(data).__name__}")
    return data


def replace(obj: T, **changes: Any) -> T:
    """dataclasses.replace that re-validates through from_dict."""
    data = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}
    data.update(changes)
    return from_dict(type(obj), data)
