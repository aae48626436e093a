"""The end-of-run report: `report.md` with a table of what a run cost, plus PNG plots. Written at
the end of every run; `python -m tools.report` writes it for any run directories.

Works on finished runs (with `summary.json`) and unfinished ones (killed, preempted, still training:
`metrics.jsonl` only). Several run dirs are overlaid: one line per run in each plot, one table row
per run. The plots need matplotlib (`pip install '.[report]'`); without it the tables are still
written, and the report says why the plots are missing.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import yaml

from loop.checkpoint.atomic import atomic_write
from loop.config.schema import ReportConfig
from loop.errors import BadInput
from loop.observe.jsonl import read_records
from loop.observe.plots import plot


def _json(path: Path) -> dict:
    try:
        return d if isinstance(d := json.loads(path.read_text()), dict) else {}  # not an object: none
    except (OSError, ValueError):  # absent or half-written: the report uses what else there is
        return {}


def _config(run_dir: Path) -> dict:
    try:  # the run's resolved config: its device when metadata.json is missing, its report settings
        return d if isinstance(d := yaml.safe_load((run_dir / "config.yaml").read_text()), dict) else {}
    except (OSError, yaml.YAMLError):
        return {}


def run_setting(run_dir: Path, key: str) -> float:
    """report.<key> from the run's config.yaml, as its end-of-run report had it: checked, as the
    file may have been edited since (a text or a negative price would be a traceback or a negative cost)."""
    value = (_config(run_dir).get("report") or {}).get(key, getattr(ReportConfig, key))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise BadInput(f"{run_dir / 'config.yaml'}: report.{key}={value!r}: expected a finite number "
                       f">= 0 (or give --{key.replace('_', '-')}).")
    return value


def _numbers(recs: list[dict], key: str) -> list[float]:
    return [r[key] for r in recs if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]


def load_run(run_dir: Path) -> dict:
    """Everything the report needs from one run directory, finished or not."""
    recs = read_records(run_dir / "metrics.jsonl")
    summ, meta, cfg = _json(run_dir / "summary.json"), _json(run_dir / "metadata.json"), _config(run_dir)
    last = recs[-1] if recs else {}
    # A summary.json is this run's end only if the log ends there too: a finished run resumed for
    # more steps (a larger train.max_steps) and stopped keeps its first end's, which the log covers;
    # one resumed back in time (run.resume=PATH) on another course and stopped at the same step
    # keeps it too, and its last step's loss and tokens are not the summary's.
    finished = "steps" in summ and summ["steps"] == last.get("step", 0) and summ.get("tokens") == last.get("tokens") \
        and repr(summ.get("final_loss")) == repr(last.get("loss"))
    summ = summ if finished else {}
    # Each interval's last record holds its mean ms_per_step over the steps since the previous such
    # record, so their products are the intervals' seconds, which add up to the training time
    # (evals and checkpoints included, process startup not). Steps dropped by a resume (after the
    # checkpoint) were truncated from the log and are not counted.
    intervals, prev = [], 0  # (interval's last record, its seconds)
    for r in (r for r in recs if "ms_per_step" in r):
        intervals.append((r, r["ms_per_step"] * max(r["step"] - prev, 0) / 1000))
        prev = r["step"]
    # No summary: wall time is rebuilt from the log.
    wall = (summ.get("wall_s") or 0.0) if finished else sum(s for _, s in intervals)
    # energy_j is the run's to each step, every start of train.py counting on from the energy the
    # log held (loop/observe/metrics.py). A drop is a count that started again (a log without an
    # earlier reading to go on from): each stretch's last reading is added. summary.json has the last.
    starts: list[float] = []
    for e in _numbers(recs, "energy_j"):
        if starts and e >= starts[-1]:
            starts[-1] = e
        else:
            starts.append(e)
    if isinstance(summ.get("energy_j"), (int, float)):
        starts[-1:] = [max(starts[-1] if starts else 0.0, summ["energy_j"])]
    steps, tokens = summ.get("steps", last.get("step", 0)), summ.get("tokens", last.get("tokens", 0))
    mem = _numbers(recs, "cuda_max_alloc_gb") + _numbers([summ], "cuda_max_alloc_gb")
    # The run's MFU is its FLOPs over its time, as mean tokens/s is its tokens over its time: each
    # interval's MFU weighs by its seconds (a short interval a checkpoint's flush ends counts less).
    timed = [(r["mfu"], s) for r, s in intervals if _numbers([r], "mfu")]
    seconds = sum(s for _, s in timed)
    mfu = [sum(m * s for m, s in timed) / seconds] if seconds else _numbers(recs, "mfu")
    vals = _numbers(recs, "val_loss") + _numbers([summ], "val_loss")
    status = "finished" + (" (stopped early)" if summ.get("stopped_early") else "") if finished \
        else f"unfinished at step {last.get('step', 0)}"
    return {
        "name": run_dir.resolve().name, "recs": recs, "status": status,
        "final_sample": (summ["steps"], summ["sample"]) if summ.get("sample") else None,
        "steps": steps, "tokens": tokens, "wall_s": wall,
        "tokens_per_s": tokens / wall if wall else None,  # a finished run's: summary.json's tokens_per_s
        "peak_gb": max(mem) if mem else None, "mfu": sum(mfu) / len(mfu) if mfu else None,
        "kwh": sum(starts) / 3.6e6 if starts else None,
        "final_loss": summ.get("final_loss") if finished else last.get("loss"),
        "best_val": min(vals) if vals else None, "world": int(meta.get("world_size") or 1),
        "best": summ.get("best") or _best_so_far(run_dir, cfg, recs),  # train.best_metric's pick
        "device": _device(meta, summ, cfg),
        "unit": (meta.get("data") or {}).get("unit") or "tokens",  # what a target is: tokens or targets
    }


def _best_so_far(run_dir: Path, cfg: dict, recs: list[dict]) -> dict | None:
    """An interrupted run's best checkpoint: the one checkpoints/best names, with its logged value."""
    try:
        step = int((run_dir / "checkpoints" / "best").read_text().strip().removeprefix("step_"))
    except (OSError, ValueError):
        return None
    metric = (cfg.get("train") or {}).get("best_metric") or "val_loss"
    value = next((r[metric] for r in recs if r.get("step") == step and metric in r), None)
    return {"metric": metric, "value": value, "step": step}


def _device(meta: dict, summ: dict, cfg: dict) -> str:
    """What the run trained on: the GPU's name (metadata.json's hardware.gpus, what a price per device
    names), else the device as configured (cpu, mps)."""
    device = str(meta.get("device") or summ.get("device") or (cfg.get("train") or {}).get("device") or "unknown")
    gpus = (meta.get("hardware") or {}).get("gpus") or []
    index = device.partition(":")[2]
    if device.startswith("cuda") and gpus:
        return str(gpus[int(index) if index.isdigit() and int(index) < len(gpus) else 0].get("name", device))
    return device


def _price(price_per_hour: float | dict[str, float], device: str) -> float:
    """A price per device-hour; a dict prices each device name (e.g. {"NVIDIA H100 80GB HBM3": 2.5,
    "cpu": 0.05}), so runs on different hardware compared in one report are each costed right;
    its "default" prices devices it does not name (else they are not costed)."""
    if isinstance(price_per_hour, dict):
        return float(price_per_hour.get(device, price_per_hour.get("default", 0.0)))
    return float(price_per_hour)


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def hms(seconds: float) -> str:  # h:mm:ss, the hours unbounded (the console's ETA too)
    return f"{round(seconds) // 3600}:{round(seconds) % 3600 // 60:02d}:{round(seconds) % 60:02d}"


def _best(best: dict | None) -> str:
    """e.g. 'val_accuracy 0.9912 at step 2000' (a classifier's best is its highest accuracy)."""
    if not best or best.get("value") is None:
        return "n/a"
    return f"{best['metric']} {best['value']:.4g} at step {best['step']}"


def unit_of(runs: list[dict]) -> str:
    """What the runs' targets are called: tokens where every run's are, else targets."""
    return "tokens" if all(r["unit"] == "tokens" for r in runs) else "targets"


def table(runs: list[dict], price_per_hour: float | dict[str, float], co2_g_per_kwh: float) -> str:
    """One row per run; a column no run has a value for (no NVML, no CUDA, no price: a run on a
    CPU) is left out rather than shown as a column of n/a."""
    unit = unit_of(runs)
    head = ["run", "status", "device", "steps", unit, "wall time", f"mean {unit}/s", "peak memory GB",
            "MFU", "energy kWh", "CO2 kg", "cost $", "final train loss", "best val loss", "best checkpoint"]
    rows = []
    for r in runs:
        price = _price(price_per_hour, r["device"])
        # Cost is what the hardware was rented for: every process holds one device for the wall time.
        cost = r["wall_s"] / 3600 * r["world"] * price if price else None
        co2 = r["kwh"] * co2_g_per_kwh / 1000 if r["kwh"] is not None else None
        rows.append([r["name"], r["status"], f"{r['device']} x{r['world']}", str(r["steps"]),
                     f"{r['tokens']:,}", hms(r["wall_s"]), _fmt(r["tokens_per_s"], ",.0f"),
                     _fmt(r["peak_gb"], ".2f"), "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%",
                     _fmt(r["kwh"], ".4f"), _fmt(co2, ".4f"), _fmt(cost, ",.4f"),
                     _fmt(r["final_loss"], ".4f"), _fmt(r["best_val"], ".4f"), _best(r["best"])])
    kept = [i for i in range(len(head)) if any(row[i] != "n/a" for row in rows)]
    lines = ["| " + " | ".join(head[i] for i in kept) + " |", "|" + "---|" * len(kept)]
    # A | in a cell (a run dir named a|b) would end it: Markdown's escape keeps the columns.
    cells = [[row[i].replace("|", r"\|") for i in kept] for row in rows]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in cells])


def write_report(run_dirs: list[Path], out_dir: Path,
                 price_per_hour: float | dict[str, float] = ReportConfig.price_per_hour,
                 co2_g_per_kwh: float = ReportConfig.co2_g_per_kwh, plots: bool = True) -> Path:
    """Write out_dir/report.md, one table row per run, and when matplotlib imports `plot`'s PNGs, one
    line per run (legend: `run_names`); return report.md's path. A run without summary.json is
    unfinished: its figures come from metrics.jsonl alone (`load_run`)."""
    run_dirs = [Path(d) for d in run_dirs]
    for d in run_dirs:
        log = d / "metrics.jsonl"
        if log.is_file() and not read_records(log) and not (d / "summary.json").exists():  # a first line cut short too
            raise FileNotFoundError(f"{d}: an empty metrics.jsonl: the run stopped before its first step")
        if not log.is_file():
            raise FileNotFoundError(f"{d}: no metrics.jsonl, so not a run directory (or the run never logged a step)")
    runs = [{**load_run(d), "name": name} for d, name in zip(run_dirs, run_names(run_dirs))]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not plots:
        plots = "Plots off (report.plots=false); `python -m tools.report RUN_DIR` draws them."
    else:
        try:
            names = plot(runs, out_dir, unit_of(runs))
            plots = "\n\n".join(f"![{n[:-4]}]({n})" for n in names) or "No plottable records."
        except ImportError:
            plots = "Plots skipped: matplotlib is not installed (`pip install '.[report]'`)."
    price = "per device " + json.dumps(price_per_hour) if isinstance(price_per_hour, dict) else f"${price_per_hour}"
    md = (f"# Run report: {', '.join(r['name'] for r in runs)}\n\n{table(runs, price_per_hour, co2_g_per_kwh)}\n\n"
          f"Wall time from summary.json (finished) or the sum of logged ms_per_step over each interval (unfinished). "
          f"Cost = wall hours x world size x {price} per device-hour (n/a when no price is set). "
          f"CO2 = kWh x {co2_g_per_kwh:g} g/kWh. Energy is NVML's reading (n/a without an NVIDIA GPU).\n\n"
          f"## Plots\n\n{plots}\n{samples(runs)}")
    path = out_dir / "report.md"
    atomic_write(path, md.encode())  # written at the end of a run: a kill mid-write leaves the old one
    return path


def run_names(run_dirs: list[Path]) -> list[str]:
    """Each run's name in the table, the legends and the samples: its directory's own name, with as
    many parent directories as tell it from the others (sweeps/lr1/seed0 and sweeps/lr2/seed0 are
    lr1/seed0 and lr2/seed0, not two rows named seed0)."""
    parts = [Path(d).resolve().parts for d in run_dirs]
    for n in range(1, max(map(len, parts), default=1) + 1):
        found = ["/".join(p[-n:]) for p in parts]
        if len(set(found)) == len(found):
            return found
    return [Path(d).resolve().name for d in run_dirs]  # one directory given twice


def samples(runs: list[dict]) -> str:
    """The newest text sample of each run (from its last evaluation, or summary.json)."""
    out = []
    for r in runs:
        found = [(x["step"], x["sample"]) for x in r["recs"] if x.get("sample")]
        if r["final_sample"]:
            found.append(r["final_sample"])
        if found:
            step, text = found[-1]
            out.append(f"**{r['name']}**, step {step}:\n\n```\n{text}\n```")
    return "\n## Samples\n\n" + "\n\n".join(out) + "\n" if out else ""
