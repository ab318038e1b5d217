"""Worker processes of the data generators that end with the process that started them.

A generator's pool (the Pathfinder workers and their progress-queue Manager, the ListOps shard pool) is shut down by
the `with` / `finally` of the process that owns it, but `kill -9` of that process (a scheduler's hard kill, the OOM
killer) runs neither: the workers went on drawing and writing images into the folder a rerun would then prepare
anew beside them. Each worker therefore watches its parent: a daemon thread polls `os.getppid()`, which changes
once the parent is gone (the orphan is re-parented), and ends the worker. A thread rather than a check per image,
so that an idle worker, blocked on its job queue, ends too; a poll rather than Linux's `PR_SET_PDEATHSIG`, which
fires when the parent's creating *thread* ends (pools start workers from helper threads) and exists only on Linux.
"""

from __future__ import annotations

import os
import threading
import time

POLL_S = 0.2  # how soon an orphaned worker ends


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    os._exit(1)  # no cleanup to run: the files of an unfinished batch are redone by the next run (atomic metadata)


def exit_with_parent(parent: int) -> None:
    """Pool `initializer`: end this worker as soon as the process `parent` (the pool's owner, `os.getpid()` there)
    is gone, checked in a daemon thread every `POLL_S` seconds."""
    if os.getppid() != parent:
        os._exit(1)
    threading.Thread(target=_watch, args=(parent,), name="exit-with-parent", daemon=True).start()
