"""Train a model with the honest loop.

    python train.py [--config configs/default.yaml] [section.key=value ...]
    torchrun --nproc_per_node=N train.py ...   (same command, many processes)

This file only wires parts together: the config, this project's data sets and models (DATASETS,
MODELS), the processes; the loop lives in loop/trainer.py. Exit codes (docs/failures.md): 0 done,
2 bad input (nothing overwritten), 3 gave up, 130 Ctrl-C, 141 the console's reader gone,
143 preempted after a checkpoint; after the last three, rerun the same command to continue.
"""
import gc
import sys

import torch

from data import DATASETS
from loop import determinism
from loop.build import build_trainer
from loop.checkpoint import runlock
from loop.checkpoint.resume import after_a_stop
from loop.config import dotenv
from loop.config.load import load_config, parse_args
from loop.config.paths import directories
from loop.device import pick_device
from loop.distributed import group
from loop.errors import EXIT_BAD_INPUT, EXIT_CONSOLE_GONE, EXIT_GAVE_UP, EXIT_INTERRUPTED, NO_ROOM
from loop.errors import BadInput, GaveUp, no_room
from loop.guards.console import HangupProof, console_gone, mute_dead_console, tell
from loop.guards.oom import beyond_split, configure_allocator
from loop.guards.preemption import EXIT_PREEMPTED
from model import MODELS


def main(argv: list[str] | None = None) -> int:
    cfg, undo = None, None
    try:
        args = parse_args(argv, DATASETS, MODELS)  # before ./.env: --help answers even with a malformed one
        dotenv.load()  # ./.env next (loop/config/dotenv.py): the config and the loop see its variables
        cfg = load_config(*args, DATASETS, MODELS)
        if cfg.run.deterministic:
            undo = determinism.enable()  # process-wide: put back at the end (a notebook's next run)
        if pick_device(cfg.train.device).type == "cuda":
            print(f"CUDA allocator: {configure_allocator()}")  # before CUDA initialises
        dist, device = group.init(cfg.train.device, cfg.train.fsdp_cpu_offload)
        summary = build_trainer(cfg, dist, device, DATASETS, MODELS).run()
        dist.barrier()  # rank 0 writes the summary and report last: the others wait, then all close
    except BadInput as e:
        tell(f"error: {e}")
        return EXIT_BAD_INPUT
    except (GaveUp, torch.OutOfMemoryError) as e:  # out of memory where no split retries it
        tell(f"error: {e if isinstance(e, GaveUp) else beyond_split(e)}")
        return EXIT_GAVE_UP
    except BrokenPipeError:  # before OSError: the console's reader went away, or a bug if not
        if not console_gone():
            raise
        tell(f"stopped: the console's reader went away; {after_a_stop(cfg and cfg.run.out_dir)}")
        return EXIT_CONSOLE_GONE
    except OSError as e:
        if e.errno not in NO_ROOM or cfg is None:  # anything else is a bug to see in full
            raise
        tell(f"error: {no_room(e, directories(cfg))}")
        return EXIT_GAVE_UP
    except KeyboardInterrupt:  # Ctrl-C: the user knows where it stopped; a traceback adds nothing
        tell(f"interrupted: {after_a_stop(cfg and cfg.run.out_dir)}")
        return EXIT_INTERRUPTED
    finally:
        runlock.release()  # the run is over: a notebook's next run, or another process's, may lock it
        group.close()
        mute_dead_console()
        if undo:
            undo()
    return EXIT_PREEMPTED if summary["preempted"] else 0


if __name__ == "__main__":
    sys.stdout, sys.stderr = (s and HangupProof(s) for s in (sys.stdout, sys.stderr))  # None: closed
    code = main()
    gc.freeze()  # all is closed: the exit need not walk torch's objects in search of garbage (0.7 s)
    sys.exit(code)
