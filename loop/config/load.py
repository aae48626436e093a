"""Typed configuration: dataclass sections, loaded from YAML, with dotted command-line overrides.

    python train.py --config configs/default.yaml optim.lr=3e-4 optim.betas.1=0.99 train.max_steps=100

The defaults are the dataclasses' (loop/config/schema.py): a file sets only what differs, and
`--help` lists every key with the value `python train.py` uses. The `data` and `model` sections
hold the loop's keys and those of the builder their `name` chooses (loop/config/builders.py), so
load_config takes the project's DATASETS and MODELS. Every key is checked before anything runs: an
unknown key gets a did-you-mean (or the builders that read it), a wrong type or an out-of-range
value names the key, the expected type and the value given, malformed YAML (a key given twice
included) names the file and line. All of these raise `BadInput` (exit code 2, nothing written).
`save` writes the resolved config; `load_config` on that file gives back an equal object.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import textwrap
from pathlib import Path

import yaml

from loop.checkpoint.atomic import atomic_write
from loop.config.builders import BASES, chosen_options, readable, unknown
from loop.config.decimal_yaml import DecimalLoader
from loop.config.fields import UnknownKey, check, from_dict, override, shown, to_dict
from loop.config.paths import check_paths
from loop.config.schema import Config
from loop.errors import BadInput

# Found from anywhere: `python ~/proj/train.py` run in another directory trains the default too
# (relative paths in a config, such as run.out_dir, stay relative to the working directory).
DEFAULT_CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "default.yaml")


def load_config(path: str | Path, overrides: list[str], datasets: dict, models: dict) -> Config:
    """YAML file + dotted overrides -> a checked Config. Raises BadInput on any problem."""
    if not str(path):  # Path("") is "." (here): "config file .: Is a directory" would name no file given
        raise BadInput("config file '' (--config): an empty path; expected a YAML file, or no --config "
                       "for the default.")
    return build(read(Path(path)), str(path), overrides, datasets, models)


def read(path: Path) -> dict:
    """A config file's mapping of sections."""
    try:
        raw = yaml.load(path.read_text(), Loader=_Loader)
    except OSError as e:
        where = "" if path.is_absolute() else f", looked for in {Path.cwd()}"
        raise BadInput(f"config file {path}: cannot read it ({e.strerror}{where}); expected a YAML file.")
    except UnicodeDecodeError as e:  # a binary file, or text in another encoding
        raise BadInput(f"config file {path}: byte {e.start} is not UTF-8 text; expected a YAML file.")
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise BadInput(f"config file {path}{where}: malformed YAML ({getattr(e, 'problem', e)}).")
    except (ValueError, RecursionError) as e:  # a date that is none (2024-13-45); lists nested 1,000 deep
        raise BadInput(f"config file {path}: a value YAML cannot read ({e}); expected a YAML file of "
                       f"plain values.") from None
    if not isinstance(raw, dict):  # empty (None), `0`, `~`: not a run on the defaults, into any out_dir
        what = "is empty" if raw is None else f"holds {type(raw).__name__} {str(raw)[:40]!r}"
        raise BadInput(f"config file {path}: it {what}; expected a mapping of sections (run:, data:, "
                       f"model:, ...), each setting only the keys that differ from the defaults.")
    return raw


def build(raw: dict, source: str, overrides: list[str], datasets: dict, models: dict) -> Config:
    """A Config from a mapping (a file's, or a checkpoint's) and dotted overrides."""
    registries = {"data": datasets, "model": models}
    names = chosen(raw, overrides, registries, source)
    sections = {s: chosen_options(s, name, registries[s][name]) for s, name in names.items()}
    try:
        cfg = from_dict(Config, raw, "", source, sections)
        for item in overrides:
            key, sep, value = item.partition("=")
            if not sep or not key:
                file = " (a config file is given as --config PATH)" if item.endswith((".yaml", ".yml")) else ""
                raise BadInput(f"override '{item}': expected the form section.key=value{file}.")
            override(cfg, key.split("."), value, key)
    except UnknownKey as e:
        raise BadInput(unknown(e.key, names, registries)) from None
    check(cfg)
    check_paths(cfg)
    return cfg


def chosen(raw: dict, overrides: list[str], registries: dict[str, dict], source: str) -> dict[str, str]:
    """data.name and model.name: the last override that sets one, else the file's."""
    names = {}
    for section, registry in registries.items():
        given = raw.get(section)
        if given is not None and not isinstance(given, dict):  # `data: text`: no name, a wrong shape
            raise BadInput(f"config {section} in {source}: expected a mapping of keys, got {shown(given)}.")
        name = given.get("name", BASES[section].name) if given else BASES[section].name
        for item in overrides:
            key, _, value = item.partition("=")
            name = value if key == f"{section}.name" else name
        if not isinstance(name, str) or name not in registry:
            raise BadInput(f"config key {section}.name: expected one of {', '.join(registry)}; got {name!r}.")
        names[section] = name
    return names


def parse_args(argv: list[str] | None, datasets: dict, models: dict) -> tuple[str, list[str]]:
    p = argparse.ArgumentParser(description="Train with the honest loop.", epilog=keys_help(datasets, models),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=DEFAULT_CONFIG, action=OnlyOnce,
                   help="YAML preset (default: %(default)s)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=3e-4")
    args = p.parse_intermixed_args(argv)  # overrides may come before and after --config
    return args.config, args.overrides


def keys_help(datasets: dict, models: dict) -> str:
    """Every key with the value `python train.py` uses (the defaults, and the data set and model its
    config file, configs/default.yaml, chooses), and each other builder's own keys: the keys without
    opening the code."""
    def shown(v) -> str:  # as YAML and the command line take them: true, [0.9,0.95]
        return json.dumps(v, separators=(",", ":")) if isinstance(v, (list, bool)) or v is None else str(v)

    def line(label: str, values: dict) -> list[str]:
        text = " ".join(f"{k}={shown(v)}" for k, v in flat(values).items()) or "(none of its own)"
        return textwrap.wrap(text, 96, initial_indent=f"  {label}: ", subsequent_indent=" " * (len(label) + 4),
                             break_on_hyphens=False)

    try:
        cfg = load_config(DEFAULT_CONFIG, [], datasets, models)
    except BadInput:  # a default config edited wrong: train.py says so when it runs
        cfg = Config()
    lines = [f"config keys, as section.key=value, with what `python train.py` uses ({DEFAULT_CONFIG}"
             f" and the defaults):"]
    for section, values in to_dict(cfg).items():
        lines += line(section, values)
        registry = {"data": datasets, "model": models}.get(section, {})
        for name, cls in readable(section, registry).items():  # a broken builder: its own run says why
            if name != values["name"]:
                opts = to_dict(cls())
                lines += line(f"  or {section}.name={name}", {k: v for k, v in opts.items() if k not in
                                                               to_dict(BASES[section]())})
    return "\n".join(lines)


def flat(d: dict, prefix: str = "") -> dict:
    """A nested config dict as {dotted key: value}."""
    out = {}
    for k, v in d.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})  # {}: a value
    return out


def differing(a: dict, b: dict) -> list[str]:
    """The keys of two flat configs whose values differ, sorted (a key only one has differs)."""
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


class OnlyOnce(argparse.Action):
    """An option given at most once: argparse keeps the last --config and drops the others unsaid."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, f"_{self.dest}_seen", False):
            parser.error(f"argument {option_string}: given twice; expected one file (later keys "
                         f"can be given as section.key=value overrides)")
        setattr(namespace, f"_{self.dest}_seen", True)
        setattr(namespace, self.dest, values)


class _Loader(DecimalLoader):
    """yaml.safe_load that refuses a key given twice in one mapping. YAML keeps the last one
    silently, so a second `train:` section at the end of a file would drop every key of the first."""

    def construct_mapping(self, node, deep=False):
        first: dict[str, int] = {}
        for key, _ in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                if key.value in first:
                    raise yaml.constructor.ConstructorError(
                        problem=f"key '{key.value}' given twice, first on line {first[key.value] + 1}; "
                                f"YAML would keep the second and drop the first without a word",
                        problem_mark=key.start_mark)
                first[key.value] = key.start_mark.line
        return super().construct_mapping(node, deep)


# ---------------------------------------------------------------------------------------- output
def changed_keys(old: dict, new: Config) -> list[str]:
    """Dotted keys whose values differ between a saved config dict and `new`."""
    return differing(flat(old), flat(to_dict(new)))


def config_hash(cfg: Config) -> str:
    return hashlib.sha256(json.dumps(to_dict(cfg), sort_keys=True).encode()).hexdigest()


def save(cfg: Config, path: Path) -> None:
    atomic_write(path, yaml.safe_dump(to_dict(cfg), sort_keys=False).encode())
