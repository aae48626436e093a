"""argparse types for the tools' command-line options, bounded as the config keys they stand for
are: a bad value is a usage error naming the option (exit 2), not a traceback after the runs."""
from __future__ import annotations

import argparse
import math

from loop.config.fields import to_float


def _finite(text: str, ok, says: str) -> float:
    value = to_float(text)
    if value is None or not (math.isfinite(value) and ok(value)):
        raise argparse.ArgumentTypeError(f"expected a finite number {says}, got {text!r}")
    return value


def non_negative(text: str) -> float:
    """argparse type for a command-line option bounded as its config key is (finite, >= 0): a
    price, a carbon intensity, a validation fraction."""
    return _finite(text, lambda v: v >= 0, ">= 0")


def positive(text: str) -> float:
    """argparse type: a finite number > 0 (a temperature)."""
    return _finite(text, lambda v: v > 0, "> 0")


def at_least(low: int, at_most: int | None = None):
    """An argparse type: an int >= `low` (and <= `at_most`). Anything else is a usage error that
    names the option (exit 2), not a ZeroDivisionError after the runs."""
    def parse(text: str) -> int:
        value = int(text)
        if value < low or (at_most is not None and value > at_most):
            within = f">= {low}" if at_most is None else f"from {low} to {at_most}"
            raise argparse.ArgumentTypeError(f"expected an integer {within}, got {value}")
        return value
    parse.__name__ = "integer"  # argparse names the type in its message for int("x")
    return parse
