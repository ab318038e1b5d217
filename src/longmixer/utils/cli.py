"""What every command-line entry point shares: a reader that stops early (`longmixer-runs | head -1`) ends the
command quietly, as it ends `ls` or `git log`, instead of with a BrokenPipeError traceback.

Python ignores SIGPIPE, so a write to a pipe whose reader has gone raises BrokenPipeError (and the flush at exit
prints "Exception ignored ..."). The remedy is the one the Python docs give (library/signal.html, "Note on SIGPIPE"):
catch it at the entry point and point stdout at /dev/null so that the exit's flush has nowhere to fail.
"""

from __future__ import annotations

import functools
import os
import select
import sys
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# The status a shell reports for a program killed by SIGPIPE (128 + 13), what `ls | head -1` gives under
# `set -o pipefail`: the output was cut short, so the command does not claim success (0), and a script that
# ignores a closed pipe on purpose treats every tool alike.
CLOSED_PIPE_EXIT = 141


def quiet_on_closed_stdout(main: Callable[..., T]) -> Callable[..., T]:
    """`main`, ending with exit status `CLOSED_PIPE_EXIT` and no traceback when its stdout's reader has gone.

    A BrokenPipeError from anything else (a socket, a worker's pipe) is raised as it is: only a closed stdout is a
    reader that stopped listening.
    """
    @functools.wraps(main)
    def run(*args, **kwargs) -> T:
        try:
            result = main(*args, **kwargs)
            sys.stdout.flush()  # output still buffered meets the closed pipe here rather than at interpreter exit
            return result
        except BrokenPipeError:
            if not _stdout_reader_gone():
                raise
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise SystemExit(CLOSED_PIPE_EXIT) from None

    return run


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe or socket with no reader left (poll reports an error or hang-up on it)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), 0)  # errors and hang-ups are reported whatever the mask
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows) or no real stdout (a test's capture)
        return False
