"""A console that went away: a pipe whose reader quit (`| head`) or a terminal that hung up. The
run notices, mutes the dead stream and ends as the signal would (train.py), without a traceback
nobody can read.
"""
import errno
import os
import select
import sys


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
    """A run's sys.stdout or sys.stderr. After a terminal hangs up (an ssh connection dropped) each
    write to it fails with EIO, and the kernel's SIGHUP, which stops the run with a checkpoint
    (loop/guards/preemption.py), is handled a moment later: a write in between mutes the console instead of
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
