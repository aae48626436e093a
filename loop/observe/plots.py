"""The report's PNG plots (loop/observe/report.py): one figure per quantity, one line per run. Needs
matplotlib; `plot` raises ImportError without it, which the report says instead of failing."""
from __future__ import annotations

import math
import sys
from pathlib import Path


def plot(runs: list[dict], out_dir: Path, unit: str = "tokens") -> list[str]:
    """One PNG per figure, one line per run; returns the file names written. `unit`: what the runs'
    targets are (tokens, or targets of a data set that is not text), for the axes' labels."""
    import matplotlib
    if "matplotlib.pyplot" not in sys.modules:
        # Headless: never open a window. Not forced when pyplot is already in use (a notebook),
        # because switching backends there closes the user's figures; Figure below needs no pyplot.
        matplotlib.use("Agg")
    from matplotlib.figure import Figure

    def series(recs: list[dict], x: str, y: str) -> tuple[list, list]:
        # Finite values only: a skipped step's NaN loss is not drawn, and would turn the log axis off.
        pts = [(r[x], r[y]) for r in recs
               if isinstance(r.get(y), (int, float)) and math.isfinite(r[y]) and r.get(x) is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    figures = {  # name: (x key, [(y key, style suffix)], x label, y label, log y)
        # Loss on a log axis: late progress is a small change of a small number, flat on a linear one.
        "loss_vs_step": ("step", [("loss", "train"), ("val_loss", "val")], "step", "loss", True),
        "loss_vs_tokens": ("tokens", [("loss", "train"), ("val_loss", "val")], unit, "loss", True),
        "lr": ("step", [("lr", "")], "step", "learning rate", False),
        "tokens_per_s": ("step", [("tokens_per_s", "")], "step", f"{unit}/s (per log interval)", True),
        "gpu_memory": ("step", [("cuda_max_alloc_gb", "")], "step", "peak CUDA memory allocated (GB)", False),
    }
    written = []
    for name, (x, ys, xlabel, ylabel, logy) in figures.items():
        if not any(series(r["recs"], x, y)[1] for r in runs for y, _ in ys):
            continue  # e.g. no GPU memory on a CPU run: no empty plot
        fig = Figure(figsize=(7, 4), dpi=110)
        ax = fig.add_subplot()
        for i, r in enumerate(runs):
            color = f"C{i % 10}"  # one colour per run; train solid, val dashed with markers
            for y, kind in ys:
                xs, vs = series(r["recs"], x, y)
                style = {"linestyle": "--", "marker": "o"} if kind == "val" else {"marker": "." if len(vs) < 30 else ""}
                if vs:
                    ax.plot(xs, vs, color=color, label=r["name"] + (f" {kind}" if kind else ""), **style)
        ax.set(xlabel=xlabel, ylabel=ylabel, title=f"{ylabel} vs {xlabel}")
        positive = all(v > 0 for r in runs for y, _ in ys for v in series(r["recs"], x, y)[1])
        ax.set_yscale("log" if logy and positive else "linear")  # a loss of 0 or below has no log
        ax.xaxis.get_major_locator().set_params(integer=True)  # steps and tokens are counts
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(out_dir / f"{name}.png")
        written.append(f"{name}.png")
    return written
