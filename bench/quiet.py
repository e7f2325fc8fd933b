"""A quiet file system before a run: what was just deleted written back, then a short wait.

On ext4 without a journal (this machine's root file system) the inode allocator steps over
every inode freed in the last 5 seconds, or in the last 305 while the inode table's block holding it
is not yet written back (``recently_deleted`` in the kernel's ``fs/ext4/ialloc.c``), and it does
so for every file and folder it makes in that block group. A bench run removes its temporary
folder (thousands of folders and files) as it ends, so the run after it (``make bench-ab``'s
next, or any run started right after another) made every file of its first half-minute
paying for that walk: measured here, 5,000 folders removed, then a ``mkdir`` cost 523 µs of
CPU at once, 115 µs after ``sync`` and 6 s, 55 µs 40 s later. That cost belongs to the run
before, not to the one measured, and it weighs on a side by how many files it makes per job.

``settle`` writes back everything dirty (``sync``) and waits ``SETTLE_S``: the recent
deletions' blocks are then clean, and deletions older than 5 s are stepped over no more.
"""

from __future__ import annotations

import os
import time

SETTLE_S = 6.0
# Set by ``make bench-ab`` for the runs it settled before: they don't wait again.
SETTLED_ENV = "GPULAYER_BENCH_SETTLED"


def settle(wait_s: float = SETTLE_S) -> float:
    """``sync``, then wait out the rest of ``wait_s``; the seconds it took."""
    started = time.monotonic()
    os.sync()
    left = wait_s - (time.monotonic() - started)
    if left > 0:
        time.sleep(left)
    return time.monotonic() - started
