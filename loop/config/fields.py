"""How a config is read and checked: YAML mappings and dotted overrides -> typed dataclass fields.

The section dataclasses themselves live in `loop/config/schema.py`. Here: unknown keys (with a
did-you-mean), type coercion (an int where a float is asked is fine; "abc" is not), list
elements by index (`optim.betas.1=0.99`), mapping entries by name, and the fields' bounds and choices.
Every problem raises `BadInput` naming the key. A key that is a Python keyword (`lab.break`) is
held in a field with a trailing underscore (`break_`); users only ever see the key.
"""
from __future__ import annotations

import dataclasses
import keyword
import math
import types
import typing

import yaml

from loop.config.decimal_yaml import DecimalLoader
from loop.errors import BadInput


def opt(default, *, min=None, max=None, above=None, below=None, choices=None, path=None, auto=False):
    """A field with optional bounds (`min` and `max` inclusive, `above` and `below` exclusive) or a set of
    allowed values, checked at load time. A list keeps its default's length, and the bounds apply
    to each element. `path`: the value is a path (`~` expanded); "dir": a directory the run reads
    or writes (data sets' caches), checked before anything is written (loop/config/paths.py).
    `auto`: the word auto is a value too, which the run resolves (data.batch_size=auto)."""
    meta = {"min": min, "max": max, "above": above, "below": below, "choices": choices, "path": path,
            "auto": auto}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def field_of(key: str) -> str:
    return f"{key}_" if keyword.iskeyword(key) else key


def key_of(field: str) -> str:
    return field[:-1] if field.endswith("_") and keyword.iskeyword(field[:-1]) else field


def to_dict(obj) -> dict:
    """A config (or section) as plain data, spelled with the keys users write."""
    return {key_of(f.name): to_dict(v) if dataclasses.is_dataclass(v := getattr(obj, f.name))
            else (type(v)(v) if isinstance(v, (list, dict)) else v) for f in dataclasses.fields(obj)}


class UnknownKey(BadInput):
    """A key no field has; loop/config/load.py says which keys there are (`key`: dotted)."""

    def __init__(self, key: str):
        super().__init__(f"unknown config key '{key}'.")
        self.key = key


def from_dict(cls, raw, prefix: str, source: str, sections: dict[str, type] | None = None):
    """`sections`: the class of a section where it is not the field's own (a builder's options)."""
    raw = {} if raw is None else raw  # an empty section in YAML reads as None
    if not isinstance(raw, dict):
        raise BadInput(f"config {prefix.rstrip('.') or 'file'} in {source}: expected a mapping of "
                       f"keys, got {shown(raw)}.")
    hints, obj, fields = typing.get_type_hints(cls), cls(), {f.name: f for f in dataclasses.fields(cls)}
    for name, section in (sections or {}).items():
        setattr(obj, name, section())
    for key_name, value in raw.items():
        key, name = f"{prefix}{key_name}", field_of(str(key_name))
        if name not in hints or key_of(name) != str(key_name):  # lab.break_: the field's name, not a key
            raise UnknownKey(key)
        if dataclasses.is_dataclass(hints[name]):
            section = (sections or {}).get(name, hints[name])
            setattr(obj, name, from_dict(section, value, key + ".", source))
        else:
            setattr(obj, name, _value(fields[name], value, hints[name], key))
    return obj


def override(obj, parts: list[str], text: str, key: str) -> None:
    name, rest = field_of(parts[0]), parts[1:]
    hints = typing.get_type_hints(type(obj)) if dataclasses.is_dataclass(obj) else {}
    if name not in hints or key_of(name) != parts[0]:
        raise UnknownKey(key)
    hint = hints[name]
    if dataclasses.is_dataclass(hint) and rest:
        return override(getattr(obj, name), rest, text, key)
    if typing.get_origin(hint) is list and len(rest) == 1:  # optim.betas.1=0.99
        items, (elem,) = getattr(obj, name), typing.get_args(hint)
        if not (rest[0].isascii() and rest[0].isdigit()) or int(rest[0]) >= len(items):
            raise BadInput(f"config key {key}: index {rest[0]} is not in a list of {len(items)}.")
        items[int(rest[0])] = _coerce(_parse(text, elem), elem, key)
        return
    if typing.get_origin(hint) is dict and rest:  # train.compile_options.triton.cudagraphs=true
        entry = ".".join(rest)
        getattr(obj, name).update(_coerce({entry: _parse(text, None)}, hint, key[: -len(entry) - 1]))
        return
    if rest:
        raise UnknownKey(key)
    f = next(f for f in dataclasses.fields(obj) if f.name == name)
    setattr(obj, name, _value(f, _parse(text, hint), hint, key))


NONE_WORDS = {"none", "null", "~", "off", "false", "no"}  # meant as "none" for a key whose none is ''


def optional(hint):
    """X for a field typed `X | None` (or `Optional[X]`), else None."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        return next(a for a in args if a is not type(None))
    return None


SCALARS = (bool, int, float, str)
TYPES = "bool, int, float, str, one of them | None, or list[one of them] (its default: opt([...]))"


def unsupported(hint) -> bool:
    """A field type no config key takes (`TYPES` lists those it does)."""
    if typing.get_origin(hint) is list:
        return typing.get_args(hint)[0] not in SCALARS
    return hint not in SCALARS and optional(hint) not in SCALARS and not dataclasses.is_dataclass(hint)


def _is_none(value) -> bool:
    """The empty value of an `X | None` key: `key=`, null or ~ (YAML's), or the word none."""
    return value is None or (isinstance(value, str) and value.strip().lower() in ("", "null", "~", "none"))


def _parse(text: str, hint):
    """Command-line text -> a Python value; strings stay verbatim so a path like 007 survives."""
    if optional(hint) is str and _is_none(text):
        return None
    if hint is str or optional(hint) is str:
        return text
    try:
        return yaml.load(text, Loader=DecimalLoader)
    except (yaml.YAMLError, ValueError, RecursionError):  # a date that is none (2024-13-45); [[[...]]]
        return text


def _value(f: dataclasses.Field, value, hint, key: str):
    """`value` for field `f`: of the field's type, or the word auto where the field takes it."""
    if hint is str and isinstance(value, str) and value.lower() in NONE_WORDS and f.default == "" \
            and not f.metadata.get("choices"):  # run.mirror=none would mirror into ./none
        raise BadInput(f"config key {key}: {value!r} would be taken as a path called {value}; expected "
                       f"a path, or {key}= (empty) for none.")
    if hint is str and isinstance(value, str) and "\0" in value:  # a path: the OS takes no NUL
        raise BadInput(f"config key {key}: expected text without a NUL character, got {shown(value)}.")
    if not f.metadata.get("auto"):
        return _coerce(value, hint, key)
    if value == "auto":
        return value
    try:
        return _coerce(value, hint, key)
    except BadInput:
        raise _wrong(key, f"{(optional(hint) or hint).__name__} or auto", value) from None


def _coerce(value, hint, key: str):
    if (inner := optional(hint)) is not None:
        if _is_none(value):
            return None
        try:
            return _coerce(value, inner, key)
        except BadInput:
            raise _wrong(key, f"{inner.__name__} or none", value) from None
    origin = typing.get_origin(hint)
    if origin is dict:  # names to scalars (train.compile_options)
        if not isinstance(value, dict):
            raise _wrong(key, "a mapping of names to values", value)
        for name, v in value.items():
            if not isinstance(v, SCALARS):
                raise BadInput(f"config key {key}.{name}: expected a bool, int, float or text, got {shown(v)}.")
        return {str(name): v for name, v in value.items()}
    if origin is list:
        (elem,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise _wrong(key, f"a list of {elem.__name__}", value)
        return [_coerce(v, elem, f"{key}.{i}") for i, v in enumerate(value)]
    if hint is bool and isinstance(value, bool):
        return value
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint is int and isinstance(value, str) and len(value.lstrip("+-").replace("_", "")) > 4300 \
            and value.lstrip("+-").replace("_", "").isdigit():
        raise BadInput(f"config key {key}: expected an integer of at most 4,300 digits (Python reads no "
                       f"longer one); got one of {len(value.lstrip('+-')):,} digits.")
    if hint is float and not isinstance(value, bool) and (number := to_float(value)) is not None:
        if not math.isfinite(number):  # nan slips past every bound (nan < 0 is False)
            raise BadInput(f"config key {key}: expected a finite number, got {shown(value)}.")
        return number
    if hint is str and isinstance(value, str):
        return value
    raise _wrong(key, hint.__name__, value)


def to_float(value) -> float | None:
    if isinstance(value, (int, float)):
        try:
            return float(value)
        except OverflowError:  # an int over 1.8e308: inf, which the caller refuses by name
            return math.inf
    try:  # PyYAML reads 3e-4 (no dot) as a string
        return float(value) if isinstance(value, str) else None
    except ValueError:
        return None


def shown(value) -> str:
    """A value for a message: its repr, cut short past 60 characters (a number of 100,000 digits)."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text):,} characters)"


def _wrong(key: str, expected: str, value) -> BadInput:
    got = "an empty value" if value is None else f"{shown(value)} ({type(value).__name__})"  # key= or key:
    return BadInput(f"config key {key}: expected {expected}, got {got}.")


def check(obj, prefix: str = "") -> None:
    """Apply the bounds and choices declared on the fields."""
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}{key_of(f.name)}"
        if dataclasses.is_dataclass(value):
            check(value, key + ".")
            continue
        if isinstance(value, list):
            if len(value) != len(f.default_factory()):
                raise _wrong(key, f"a list of {len(f.default_factory())} values", value)
            for i, v in enumerate(value):
                _bounds(v, f.metadata, f"{key}.{i}")
        elif not (f.metadata.get("auto") and value == "auto") and value is not None:  # None: X | None's none
            _bounds(value, f.metadata, key)
        choices = f.metadata.get("choices")
        if choices and value not in choices and value is not None:  # None: X | None's none
            allowed = ", ".join(c or '""' for c in choices)  # "" is a choice too (lab.break)
            raise BadInput(f"config key {key}: expected one of {allowed}; "
                           f"got {shown(value)}.")


INT64 = 2**63 - 1  # the largest count a tensor or itertools.islice takes (a batch's samples)


def _bounds(value, meta, key: str) -> None:
    for name, fails, says in (("min", lambda v, b: v < b, ">="), ("max", lambda v, b: v > b, "<="),
                              ("above", lambda v, b: v <= b, ">"), ("below", lambda v, b: v >= b, "<")):
        bound = meta.get(name)
        if bound is not None and fails(value, bound):
            raise BadInput(f"config key {key}: expected a value {says} {bound}, got {shown(value)}.")
