"""Typed configs: dataclasses built from dicts that reject unknown keys, plus dotted overrides.

Every config in dspine (drafter, training, evaluation, serving) is a dataclass read through
`from_dict`, so a typo in a JSON file or on the command line is an error that names the key
instead of a silently ignored setting.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value or key that dspine cannot accept."""


def _union(value, tp, args, where):
    if value is None and type(None) in args:
        return None
    for a in args:
        if a is type(None):
            continue
        try:
            return _coerce(value, a, where)
        except ConfigError:
            pass
    raise ConfigError(f"{where}: {value!r} fits none of {tp}")


def _literal(value, args, where):
    if value not in args:
        raise ConfigError(f"{where}: {value!r} is not one of {list(args)}")
    return value


def _list(value, args, where):
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{where}: expected a list, got {value!r}")
    inner = args[0] if args else Any
    return [_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]


def _dict(value, args, where):
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping, got {value!r}")
    inner = args[1] if len(args) == 2 else Any
    return {k: _coerce(v, inner, f"{where}.{k}") for k, v in value.items()}


def _dataclass(value, tp, where):
    if isinstance(value, tp):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping for {tp.__name__}, got {value!r}")
    return from_dict(tp, value, where)


def _bool(value, where):
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    raise ConfigError(f"{where}: expected true/false, got {value!r}")


def _int(value, where):
    bad = ConfigError(f"{where}: expected an integer, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, (int, str, float)):
        raise bad
    try:
        f = float(value)
    except ValueError:
        raise bad from None
    if f != int(f):
        raise bad
    return int(f)


def _float(value, where):
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: expected a number, got {value!r}") from None


def _str(value, where):
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    return value


_SCALARS = {bool: _bool, int: _int, float: _float, str: _str}


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        return _union(value, tp, args, where)
    if origin is typing.Literal:
        return _literal(value, args, where)
    if origin in (list, tuple):
        return _list(value, args, where)
    if origin is dict:
        return _dict(value, args, where)
    if dataclasses.is_dataclass(tp):
        return _dataclass(value, tp, where)
    if tp in _SCALARS:
        return _SCALARS[tp](value, where)
    return value


def from_dict(cls: type[T], data: dict, where: str | None = None) -> T:
    """Build dataclass `cls` from `data`; unknown keys and ill-typed values raise ConfigError."""
    where = where or cls.__name__
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; known keys: {sorted(fields)}")
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}") for k, v in data.items()}
    try:
        obj = cls(**kwargs)
    except TypeError as e:  # a missing required field
        raise ConfigError(f"{where}: {e}") from None
    check = getattr(obj, "validate", None)
    if check is not None:
        check()
    return obj


def to_dict(obj: Any) -> dict:
    return dataclasses.asdict(obj)


def _parse_scalar(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _merged(base: dict, fields: dict) -> dict:
    out = dict(base)
    for k, v in fields.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def configure(cls: type[T], overrides: list[str], **fields) -> T:
    """An entry point's config: `cls`'s defaults, then `fields` (its options; dicts merge into sections), then
    the dotted `overrides` -> a checked `cls` (unknown keys refused)."""
    return from_dict(cls, apply_overrides(_merged(to_dict(cls()), fields), overrides))


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b.c=value` overrides (values parsed as JSON when they parse, else kept as strings)."""
    out = json.loads(json.dumps(data))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key.path=value")
        path, raw = item.split("=", 1)
        keys = [k for k in path.strip().split(".") if k]
        if not keys:
            raise ConfigError(f"override {item!r} has an empty key")
        node = out
        for k in keys[:-1]:
            nxt = node.get(k)
            if nxt is None:
                nxt = node[k] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r}: {k!r} is not a section")
            node = nxt
        node[keys[-1]] = _parse_scalar(raw)
    return out


def option(default: Any = None, help: str = "", flag: str | None = None, env: str | None = None, **argparse_kw):
    """A config field whose command-line option is declared once, on the field (peft's LoraConfig way): its
    help, and optionally its flag (default --field-name), an environment variable read for the default, and
    argparse keywords (choices, metavar). `add_arguments` builds the options from it."""
    meta = {"help": help, "flag": flag, "env": env, "argparse": argparse_kw}
    return dataclasses.field(default=default, metadata=meta)


def _arg_type(tp: Any):
    """int | None -> int; bool -> None (a switch); str/float/int as they are."""
    args = (
        [a for a in typing.get_args(tp) if a is not type(None)]
        if typing.get_origin(tp) in (typing.Union, types.UnionType)
        else [tp]
    )
    return args[0] if args and args[0] in (int, float, str, bool) else str


def add_arguments(parser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """One argparse option per `option` field of the dataclass `cls` (fields without one are not options)."""
    import os

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata or f.name in skip:
            continue
        meta, tp = f.metadata, _arg_type(hints[f.name])
        flag = meta["flag"] or "--" + f.name.replace("_", "-")
        default = os.environ.get(meta["env"], f.default) if meta["env"] else f.default
        shown = f"${meta['env']}" if meta["env"] else (None if f.default is None else "%(default)s")
        text = f"{meta['help']} (default: {shown})" if shown else meta["help"]  # None: the help says what applies
        kw = dict(dest=f.name, default=default, help=text, **meta["argparse"])
        if tp is not bool and "choices" not in kw:
            kw.setdefault("metavar", flag.lstrip("-").replace("-", "_").upper())
        if tp is bool:
            parser.add_argument(flag, action="store_true", **kw)
        else:
            parser.add_argument(flag, type=tp, **kw)


def from_arguments(cls: type[T], ns, **fields) -> T:
    """The dataclass from the parsed options that `add_arguments` declared (plus `fields`)."""
    names = {f.name for f in dataclasses.fields(cls) if "help" in f.metadata}
    return cls(**{**{n: getattr(ns, n) for n in names if hasattr(ns, n)}, **fields})
