"""The ways a run ends with a message instead of a traceback.

`BadInput` (config, data, checkpoint): `train.py` prints the message and exits 2, before anything
in `run.out_dir` is written or changed, but for what only a training step can show (a loss
detached from the weights, a parameter without gradient under DDP), after the run's first files.
Raise it with a message that names the key or file and says what was expected. `GaveUp`: training
started but cannot continue; exit 3, as for any write the system refuses for want of room
(`NO_ROOM`). Ctrl-C (KeyboardInterrupt): exit 130, as a shell reports it; the checkpoints on disk
are whole (atomic writes), so the same command continues from the newest. A console whose reader
went away (`python train.py | head`, `less` quit): exit 141, as a shell reports a SIGPIPE, and no
traceback (nobody could read it); a `tee` ended by the same Ctrl-C as the run still gives 130 (the
Ctrl-C came first); loop/guards/console.py notices that.
"""

import errno

EXIT_BAD_INPUT = 2
EXIT_GAVE_UP = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_CONSOLE_GONE = 141  # 128 + SIGPIPE


class BadInput(Exception):
    """User-facing input error: the message is printed as is, and the process exits with 2."""


class GaveUp(Exception):
    """Training cannot go on (non-finite values under nan_policy=abort, too many bad steps in a row,
    out of memory at micro-batch 1 or inside collectives over the ranks, a checkpoint the disk
    refuses): the message is a diagnostic, and the process exits with 3."""


# A write the system refused for want of room: a full disk, a quota, a file-size limit (ulimit -f).
NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def no_room(e: OSError, dirs: dict[str, str]) -> str:
    """The message for a write refused for want of room; `dirs`: config key -> its directory."""
    what = f" to {e.filename}" if e.filename else ""
    where = " and ".join(f"{k} ({v})" for k, v in dirs.items())
    return (f"a write{what} was refused: {e.strerror}. The disk is full, or a quota or file-size "
            f"limit was reached. Any steps trained since the newest checkpoint are lost; the "
            f"checkpoints are whole. Free space in {where} and rerun the same command to continue "
            f"from the newest.")
