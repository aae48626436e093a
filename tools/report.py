"""Write report.md (tables and plots) for one run directory, or several side by side.

    python -m tools.report RUN_DIR [RUN_DIR ...] [--out DIR] [--price-per-hour X] [--co2-g-per-kwh Y]

Works on finished runs and unfinished ones (loop/observe/report.py says what it reads). Exit
codes: 0 written, 2 bad input (a RUN_DIR without metrics.jsonl).
"""
from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

from loop.config.arguments import non_negative
from loop.config.paths import writable_dir
from loop.errors import EXIT_BAD_INPUT, BadInput
from loop.observe.report import run_names, run_setting, write_report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.report", description=__doc__.splitlines()[0])
    p.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    p.add_argument("--out", type=Path, help="default: the run dir (one run) or reports/A_vs_B (several)")
    p.add_argument("--price-per-hour", type=non_negative, help="$ per device-hour (default: the first "
                   "RUN_DIR's report.price_per_hour; 0: no cost)")
    p.add_argument("--co2-g-per-kwh", type=non_negative, help="grid g/kWh (default: the first RUN_DIR's report.co2_g_per_kwh)")
    a = p.parse_args(argv)
    out = a.out or (a.run_dirs[0] if len(a.run_dirs) == 1 else default_out(a.run_dirs))
    try:
        for d in a.run_dirs:  # else a file named as RUN_DIR is blamed on --out, which was not given
            if d.is_file():
                raise BadInput(f"{d}: a file; expected a run directory (such as {d.parent}, if it "
                               f"holds metrics.jsonl).")
        writable_dir("option --out", str(out))
        price = run_setting(a.run_dirs[0], "price_per_hour") if a.price_per_hour is None else a.price_per_hour
        co2 = run_setting(a.run_dirs[0], "co2_g_per_kwh") if a.co2_g_per_kwh is None else a.co2_g_per_kwh
        path = write_report(a.run_dirs, out, price, co2)
    except (FileNotFoundError, BadInput) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (TypeError, ValueError, AttributeError, KeyError) as e:  # a file edited into another shape
        print(f"error: {', '.join(map(str, a.run_dirs))}: a run file holds a value of another kind than "
              f"a run writes ({type(e).__name__}: {e}); expected metrics.jsonl, summary.json, "
              f"metadata.json and config.yaml as the run wrote them.", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"report written: {path}")
    return 0


def default_out(run_dirs: list[Path]) -> Path:
    """reports/A_vs_B. A sweep's runs side by side (runs/sweep/*) would name a directory longer
    than a file system takes (255 bytes): then the first run and how many more, with a hash of
    every name, so another sweep's report that starts with the same run is not overwritten."""
    names = [n.replace("/", "-") for n in run_names(run_dirs)]
    joined = "_vs_".join(names)
    if len(joined.encode()) <= 200:
        return Path("reports") / joined
    digest = hashlib.sha256("\0".join(names).encode()).hexdigest()[:8]
    first = names[0].encode()[:100].decode(errors="ignore")
    return Path("reports") / f"{first}_and_{len(names) - 1}_more_{digest}"


if __name__ == "__main__":
    sys.exit(main())
