"""The ways a run ends with a message instead of a traceback.

`BadInput` (config, data, checkpoint): `train.py` prints the message and exits 2, before anything
in `run.out_dir` is written or changed. Raise it with a message that names the key or file and
says what was expected. `GaveUp`: training started but cannot continue; exit 3, as for any write
the system refuses for want of room (`NO_ROOM`). Ctrl-C (KeyboardInterrupt): exit 130, as a shell
reports it; the checkpoints on disk are whole (atomic writes), so the same command continues from
the newest. A console whose reader went away (`python train.py | head`, `less` quit): exit 141, as a shell
reports a SIGPIPE, and no traceback (nobody could read it); a `tee` ended by the same Ctrl-C as the
run still gives 130 (the Ctrl-C came first).
"""

import errno
import os
import select
import sys

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


def gone(fd: int) -> bool:
    """Whether writing to `fd` would raise BrokenPipeError: a pipe or socket whose reader is gone."""
    poll = select.poll()
    poll.register(fd, select.POLLOUT)
    return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poll.poll(0))


def console_gone() -> bool:
    return gone(1) or gone(2)


def tell(message: str) -> None:
    """Print an ending's message to stderr if anyone can still read it: the exit code says it too."""
    try:
        print(message, file=sys.stderr, flush=True)
    except BrokenPipeError:
        pass


class HangupProof:
    """A run's sys.stdout or sys.stderr. After a terminal hangs up (an ssh session dropped) each
    write to it fails with EIO, and the kernel's SIGHUP, which stops the run with a checkpoint
    (loop/guards.py), is handled a moment later: a write in between mutes the console instead of
    ending the run with a traceback nobody sees and the steps since the newest checkpoint lost."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        self._survive(self.stream.write, text)
        return len(text)

    def flush(self) -> None:
        self._survive(self.stream.flush)

    def _survive(self, fn, *args) -> None:
        try:
            fn(*args)
        except OSError as e:  # BrokenPipeError (EPIPE: `| head`) is train.py's, exit 141
            if e.errno != errno.EIO or not console_gone():
                raise
            mute_dead_console()

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def mute_dead_console() -> None:
    """Point a gone stdout or stderr at /dev/null, so that nothing fails writing to it any more;
    the interpreter's last flush of stdout included, which would make the exit code 120."""
    dead = [fd for fd in (1, 2) if gone(fd)]
    if dead:
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in dead:
            os.dup2(devnull, fd)
        os.close(devnull)
