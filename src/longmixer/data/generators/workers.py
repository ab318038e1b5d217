"""Worker processes of the data generators that end with the process that started them.

A generator's pool (the Pathfinder workers and their progress-queue Manager, the ListOps shard pool) is shut down by
the `with` / `finally` of the process that owns it, but `kill -9` of that process (a scheduler's hard kill, the OOM
killer) runs neither: the workers went on drawing and writing images into the folder a rerun would then prepare
anew beside them. Each worker therefore watches its owner from a daemon thread: it ends once its parent process
changes (under fork and spawn the parent is the owner, and an orphan is re-parented) or the owner's pid is gone
(under forkserver, Python 3.14's default on Linux, the parent is the fork server). A thread rather than a check per
image, so that an idle worker, blocked on its job queue, ends too; a poll rather than Linux's `PR_SET_PDEATHSIG`,
which fires when the parent's creating *thread* ends (pools start workers from helper threads) and exists only on
Linux.
"""

from __future__ import annotations

import os
import threading
import time

POLL_S = 0.2  # how soon an orphaned worker ends


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # a process of another user took the pid: ours is gone
        return True
    return False


def _watch(owner: int, parent: int) -> None:
    while os.getppid() == parent and not _gone(owner):
        time.sleep(POLL_S)
    os._exit(1)  # no cleanup to run: the files of an unfinished batch are redone by the next run (atomic metadata)


def exit_with_parent(owner: int) -> None:
    """Pool `initializer`: end this worker as soon as the process `owner` (the pool's owner, `os.getpid()` there)
    is gone, checked in a daemon thread every `POLL_S` seconds."""
    if _gone(owner):
        os._exit(1)
    threading.Thread(target=_watch, args=(owner, os.getppid()), name="exit-with-parent", daemon=True).start()
