"""The ways a run ends with a message instead of a traceback.

`BadInput` (config, data, checkpoint): `train.py` prints the message and exits 2, before anything
in `run.out_dir` is written or changed. Raise it with a message that names the key or file and
says what was expected. `GaveUp`: training started but cannot continue; exit 3. Ctrl-C
(KeyboardInterrupt): exit 130, as a shell reports it; the checkpoints on disk are whole (atomic
writes), so the same command continues from the newest.
"""

EXIT_BAD_INPUT = 2
EXIT_GAVE_UP = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT


class BadInput(Exception):
    """User-facing input error: the message is printed as is, and the process exits with 2."""


class GaveUp(Exception):
    """Training cannot go on (non-finite values under nan_policy=abort, too many bad steps in a row,
    out of memory at micro-batch 1 or inside collectives over the ranks, a checkpoint the disk
    refuses): the message is a diagnostic, and the process exits with 3."""
