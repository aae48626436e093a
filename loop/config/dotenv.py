"""Load `.env` from the current working directory into the environment: secrets such as the checkpoint
mirror's credentials stay out of the shell history, the config and the repository.

    cp .env.example .env     # then fill it in; .env is git- and docker-ignored
    python train.py ...      # train.py calls dotenv.load() first, before the config is read

Format, one entry a line: `KEY=VALUE`, optionally prefixed by `export ` (so the file can also be
`source`d). Blank lines and lines starting with `#` are skipped. A value in matching single or double
quotes is taken literally without them (no escapes, no `${VAR}` expansion, no multi-line values);
an unquoted value is the rest of the line, surrounding spaces stripped (so `#` inside it is kept).
A name given twice: the last line wins. A variable already in the environment wins over `.env`,
so `KEY=x python train.py` still overrides it.

A malformed line raises `BadInput` (exit 2, nothing in run.out_dir written) naming `.env` and the
line number, never the line, which may hold a secret. The names taken from `.env` are kept in
`FROM_FILE`, and loop/observe/metadata.py leaves them out of the recorded environment: a value that came
from `.env` is not written to the run directory, even under a name that does not look secret. Two
settings are the exception, recorded with their values wherever they come from (determinism.py):
CUBLAS_WORKSPACE_CONFIG and PYTORCH_ALLOC_CONF; keep them out of `.env`.

It runs after `import torch`, so settings torch reads at import (OMP_NUM_THREADS, MKL_NUM_THREADS)
have no effect from `.env`: export those. Settings read later (NCCL_*, CUDA_VISIBLE_DEVICES, AWS_*)
work. Under torchrun each worker loads `.env` itself; torchrun does not.
"""
from __future__ import annotations

import os
import re
from collections.abc import MutableMapping
from pathlib import Path

from loop.errors import BadInput

ENV_FILE = ".env"
LINE = re.compile(r"(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(.*)")
FROM_FILE: set[str] = set()  # names this process took from .env (see the module docstring)


def _malformed(source: str, number: int) -> BadInput:
    return BadInput(f"{source} line {number}: expected KEY=VALUE (a name of letters, digits and _, "
                    f"then =, then the value, in matching ' or \" quotes if quoted, nothing after "
                    f"the closing quote). The line is not shown: it may hold a secret.")


def parse(text: str, source: str = ENV_FILE) -> dict[str, str]:
    """The entries of a .env text. Raises BadInput naming `source` and the line number."""
    entries = {}
    for number, line in enumerate(re.split(r"\r\n|\r|\n", text), 1):  # splitlines() splits at \f, U+2028 too
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = LINE.fullmatch(line)
        if match is None or "\0" in line:  # an environment value cannot hold NUL (a ValueError)
            raise _malformed(source, number)
        name, value = match.groups()
        if value[:1] in ("'", '"'):
            quote = value[0]
            if len(value) < 2 or value[-1] != quote or quote in value[1:-1]:
                raise _malformed(source, number)
            value = value[1:-1]
        entries[name] = value
    return entries


def load(path: str | Path = ENV_FILE,
         environ: MutableMapping[str, str] = os.environ) -> list[str]:
    """Set the entries of `path` that `environ` does not have yet; return their names (none if the
    file does not exist). The whole file is checked before anything is set."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")  # -sig: tolerate the BOM some editors write
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"{path}: cannot read it ({e}); expected a UTF-8 text file of KEY=VALUE "
                       f"lines.") from e
    entries = parse(text, str(path))
    names = [name for name in entries if name not in environ]
    for name in names:
        environ[name] = entries[name]
    FROM_FILE.update(names)
    return names
