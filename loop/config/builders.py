"""Options that belong to a builder. The project names its data sets and models in two dicts,
DATASETS (data/__init__.py) and MODELS (model/__init__.py), name -> builder, which train.py hands to
the loop. A builder's first parameter is annotated with its options: a dataclass that extends the
loop's section, whose keys it adds to `data` (or `model`):

    @dataclass
    class MineOptions(DataSection):        # data.name=mine: these keys beside the loop's
        path: str = opt("", path=True)
        seq_len: int = opt(64, min=1)

    def build_mine(opts: MineOptions) -> Data: ...                     # a data set
    def build_mlp(opts: MLPOptions, data: Data) -> nn.Module: ...      # a model

A builder without one reads the loop's keys only. The config's `data` section is then the chosen
builder's dataclass, so a key it does not read is refused, naming the keys it reads and the
builders that read that key.
"""
from __future__ import annotations

import dataclasses
import difflib
import inspect
import typing
from typing import Callable

from loop.config.fields import TYPES, key_of, unsupported
from loop.config.schema import Config, DataSection, ModelSection
from loop.errors import BadInput

BASES = {"data": DataSection, "model": ModelSection}


def chosen_options(section: str, name: str, builder: Callable) -> type:
    """`options_of` the builder a run chose, checked as the run will call it: its parameters, and
    a type on each field that a config key takes (else a traceback, or a key no value passes,
    later). Builders the run did not choose are not its problem (`--help` lists them)."""
    called = "(options)" if section == "data" else "(options, data)"
    try:
        inspect.signature(builder).bind(*called.strip("()").split(", "))
    except TypeError as e:
        raise BadInput(f"config key {section}.name={name}: its builder {builder.__name__} cannot be called as "
                       f"{builder.__name__}{called} ({e}); expected a function of those parameters.") from None
    cls = options_of(section, name, builder)
    for key, hint in typed_keys(cls):
        if unsupported(hint):
            raise BadInput(f"config key {section}.{key} ({section}.name={name}): typed {hint!r} in "
                           f"{cls.__name__}, which no config key takes; expected {TYPES}.")
    if missing := without_default(cls):  # cls() would be a TypeError traceback as the config is read
        raise BadInput(f"config key {section}.{missing[0]} ({section}.name={name}): no default in "
                       f"{cls.__name__}; expected a default on every option (the value a run uses "
                       f"where its config does not set the key).")
    return cls


def without_default(cls: type, prefix: str = "") -> list[str]:
    """The dotted keys of a section class whose fields have neither a default nor a default_factory
    (a kw_only dataclass's may not), nested sections spelled out."""
    out, hints = [], typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            out.append(f"{prefix}{key_of(f.name)}")
        elif dataclasses.is_dataclass(hints[f.name]):
            out += without_default(hints[f.name], f"{prefix}{key_of(f.name)}.")
    return out


def readable(section: str, registry: dict) -> dict[str, type]:
    """name -> options class of each builder whose options can be read: those the run did not
    choose are listed (`--help`) and searched (a key's did-you-mean) where they can be, and a
    broken one fails only the run that chooses it (`chosen_options` says why)."""
    out = {}
    for name, builder in registry.items():
        try:
            cls = options_of(section, name, builder)
        except BadInput:
            continue
        if not without_default(cls):
            out[name] = cls
    return out


def options_of(section: str, name: str, builder: Callable) -> type:
    """The options class of `builder`, registered as `section`.name=`name`."""
    first = next(iter(inspect.signature(builder).parameters), None)
    try:
        hint = typing.get_type_hints(builder).get(first) if first else None
    except NameError as e:  # an annotation naming a class its module does not have at the top level
        raise BadInput(f"config key {section}.name={name}: its builder {builder.__name__}'s annotations "
                       f"cannot be read ({e}); expected its options class defined or imported at the "
                       f"top of its module.") from None
    base = BASES[section]
    if hint is None:
        return base
    if not (isinstance(hint, type) and dataclasses.is_dataclass(hint) and issubclass(hint, base)):
        raise BadInput(f"config key {section}.name={name}: its builder {builder.__name__} takes "
                       f"{hint!r} as its first parameter; expected a dataclass that extends "
                       f"loop.config.schema.{base.__name__} (the options it reads), or no annotation.")
    return hint


def typed_keys(cls: type, prefix: str = "") -> list[tuple[str, object]]:
    """(dotted key, type) of each field of a section class, nested sections spelled out."""
    out, hints = [], typing.get_type_hints(cls)
    for name in (f.name for f in dataclasses.fields(cls)):  # not a ClassVar: no key
        key, hint = f"{prefix}{key_of(name)}", hints[name]
        out += typed_keys(hint, key + ".") if dataclasses.is_dataclass(hint) else [(key, hint)]
    return out


def keys(cls: type) -> list[str]:
    """The dotted keys of a section class, nested sections spelled out."""
    return [key for key, _ in typed_keys(cls)]


def own(cls: type, section: str) -> list[str]:
    """The names a builder's options add to the section (a nested section by its name)."""
    base = {f.name for f in dataclasses.fields(BASES[section])}
    return [key_of(f.name) for f in dataclasses.fields(cls) if f.name not in base]


def unknown(key: str, names: dict[str, str], registries: dict[str, dict]) -> str:
    """The message for a key no field has: in `data` or `model` (`names`: the builders chosen), what
    the chosen builder reads and which builders read that key; elsewhere, or below a key it reads,
    a near spelling, or the same name in another section."""
    section, _, rest = key.partition(".")
    nest = f" In a file, nest it: {section}: then {rest}: (dotted keys are for the command line)."
    if section in names:
        registry, name = registries[section], names[section]
        cls = options_of(section, name, registry[name])
        if rest in keys(cls):  # `model.n_layer: 3` in a file: one name with a dot in it
            return f"unknown config key '{key}'.{nest}"
        mine = ", ".join(f"{section}.{k}" for k in own(cls, section)) or "none of its own"
        reads = f"{section}.name={name} reads {mine}"
        first = rest.split(".")[0]
        others = [n for n, c in readable(section, registry).items() if first in own(c, section)]
        if others and first not in [key_of(f.name) for f in dataclasses.fields(cls)]:
            return (f"config key {key}: {reads}, not this one; {section}.{first} is for {section}.name="
                    f"{', '.join(others)}. Set {section}.name to the one it is for, or leave the key out "
                    f"(a config file written for another {section}.name sets keys this one does not read).")
        guess = difflib.get_close_matches(rest, keys(cls), n=1, cutoff=0.6)
        hint = f" Did you mean '{section}.{guess[0]}'?" if guess else ""
        return f"unknown config key '{key}'.{hint} {reads}, beside the loop's {section} keys."
    known = keys(Config)
    parent, _, leaf = key.rpartition(".")
    # A near spelling in the same section, then the same name in another section (train.lr ->
    # optim.lr), then a near spelling anywhere.
    prefix = f"{parent}." if parent else ""
    siblings = {k[len(prefix):].split(".")[0] for k in known if k.startswith(prefix)}
    guess = [prefix + g for g in difflib.get_close_matches(leaf, siblings, 1, 0.6)]
    guess = guess or [k for k in known if k.rpartition(".")[2] == leaf][:1]
    guess = guess or difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f" Did you mean '{guess[0]}'?" if guess else ""
    if key in known:  # as above, in a section of the loop's
        hint = nest
    return f"unknown config key '{key}'.{hint} Known sections: {', '.join(typing.get_type_hints(Config))}."
