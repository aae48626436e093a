"""Where a run reads and writes, checked before anything is written: `~` expanded, directories
that can be made, and no run.out_dir or local run.mirror inside what another run writes. A key
holds a path when its field says so (`opt(..., path=True)`, loop/config/fields.py): the loop's and
any builder's; `path="dir"` marks a directory a data set reads or writes (its cache).
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from loop.checkpoint.runlock import refuse_nested
from loop.config.fields import key_of
from loop.errors import BadInput


def path_keys(obj, kind=None, prefix: str = ""):
    """(dotted key, section object, field name) of every path field (of `kind`, if given)."""
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}{key_of(f.name)}"
        if dataclasses.is_dataclass(value):
            yield from path_keys(value, kind, key + ".")
        elif f.metadata.get("path") and kind in (None, f.metadata["path"]):
            yield key, obj, f.name


def directories(cfg) -> dict[str, str]:
    """The directories a run writes, by key (run.out_dir, the data set's cache): where a full disk
    needs room."""
    return {"run.out_dir": cfg.run.out_dir,
            **{key: getattr(obj, name) for key, obj, name in path_keys(cfg, "dir") if getattr(obj, name)}}


def check_paths(cfg) -> None:
    # A shell expands ~ only at the start of a word: from `make ARGS="run.out_dir=~/x"` or a YAML
    # file it reaches the run as text, and would make a directory named ~ here.
    for key, obj, name in path_keys(cfg):
        if (value := getattr(obj, name)) and value.startswith("~"):  # None: a `str | None` key's none
            setattr(obj, name, os.path.expanduser(value))
    writable_dir("config key run.out_dir", cfg.run.out_dir)
    for key, obj, name in path_keys(cfg, "dir"):
        if getattr(obj, name) is not None:
            writable_dir(f"config key {key}", getattr(obj, name), write=False)  # read-only if prepared
    refuse_nested("run.out_dir", Path(cfg.run.out_dir))
    if cfg.run.mirror:
        from fsspec.core import split_protocol

        protocol, path = split_protocol(cfg.run.mirror)
        if protocol in (None, "file", "local"):  # a directory: it could be a run's checkpoints/
            refuse_nested("run.mirror", Path(path), also=Path(cfg.run.out_dir))


def writable_dir(name: str, path: str, write: bool = True) -> None:
    """`path` is a directory, or one can be made there: checked before anything is written, so a
    file in the way is a clear error (exit 2), not a traceback after half a setup. `name` says
    what gave the path: "config key run.out_dir", "option --out". `write=False`: one to read from
    may do (a prepared data cache: the places that write into it check again)."""
    if not path:
        raise BadInput(f"{name}: expected a directory path, got ''.")
    try:
        path.encode()
    except UnicodeEncodeError:  # bytes of another encoding: the run's files and TensorBoard need text
        raise BadInput(f"{name}={path!r}: not UTF-8 text; expected a directory path in UTF-8 (rename "
                       f"the directory, or choose another).") from None
    there = Path(path).absolute()
    try:
        there.exists()
    except OSError as e:  # a part longer than the file system allows (ENAMETOOLONG): a traceback
        raise BadInput(f"{name}={path}: {e.strerror}; expected a directory path.") from None
    while not there.exists():  # the nearest part of the path that exists
        if there.is_symlink():  # mkdir would meet it: FileExistsError, a traceback mid-setup
            raise BadInput(f"{name}={path}: {there} is a symbolic link to {os.readlink(there)}, which "
                           f"does not exist; expected a directory, or a path where one can be made.")
        there = there.parent
    if not there.is_dir():
        raise BadInput(f"{name}={path}: {there} is a file; expected a directory, or a path "
                       f"where one can be made.")
    if write and not os.access(there, os.W_OK | os.X_OK):
        raise BadInput(f"{name}={path}: cannot write in {there}; expected a directory "
                       f"this user can write to.")
