"""Prepare a corpus ahead of time (train.py does it too, on first use; data/corpus.py does the work).

    python -m data.prepare                 # the Python docs that ship inside CPython (offline)
    python -m data.prepare --path my.txt   # any local text file

Prints the prepared directory. Bad input (a file that cannot be read as UTF-8 text, a split with
nothing on one side, a cache prepared before and damaged since) exits 2 with a message naming it,
as train.py does.
"""
from __future__ import annotations

import argparse
import sys

from data.corpus import prepare_text, text_and_source
from data.tokens import token_data
from loop.config.arguments import non_negative
from loop.config.paths import writable_dir
from loop.errors import EXIT_BAD_INPUT, BadInput


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m data.prepare", description=__doc__.splitlines()[0])
    p.add_argument("--path", default="", help="text file (default: the embedded Python docs)")
    p.add_argument("--out", default="data/cache", help="cache directory")
    p.add_argument("--val-fraction", type=non_negative, default=0.1)
    a = p.parse_args(argv)
    try:
        writable_dir("option --out", a.out)
        out = prepare_text(*text_and_source(a.path), a.out, a.val_fraction)
        token_data(out, seq_len=1)  # one prepared before and damaged since is refused, as train.py does
        print(out)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main())
