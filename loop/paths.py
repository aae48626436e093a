"""Where a run reads and writes, checked before anything is written: `~` expanded, directories
that can be made, and no run.out_dir or local run.mirror inside what another run writes."""
from __future__ import annotations

import os
from pathlib import Path

from loop.config_check import writable_dir
from loop.runlock import refuse_nested

# Keys that hold a path. A shell expands ~ only at the start of a word: in `make ARGS="run.out_dir=~/x"`
# or a YAML file it reached the run as text, and made a directory named ~ here.
PATHS = [("run", "out_dir"), ("run", "resume"), ("run", "init_from"), ("run", "mirror"),
         ("data", "cache_dir"), ("data", "path")]


def check_paths(cfg) -> None:
    for section, key in PATHS:
        if (value := getattr(getattr(cfg, section), key)).startswith("~"):
            setattr(getattr(cfg, section), key, os.path.expanduser(value))
    writable_dir("config key run.out_dir", cfg.run.out_dir)
    writable_dir("config key data.cache_dir", cfg.data.cache_dir, write=False)  # read-only if prepared
    refuse_nested("run.out_dir", Path(cfg.run.out_dir))
    if cfg.run.mirror:
        from fsspec.core import split_protocol

        protocol, path = split_protocol(cfg.run.mirror)
        if protocol in (None, "file", "local"):  # a directory: it could be a run's checkpoints/
            refuse_nested("run.mirror", Path(path), also=Path(cfg.run.out_dir))
