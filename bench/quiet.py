"""A quieter file system before a run: what was just deleted written back, then a short wait.

On ext4 without a journal (this machine's root file system) the inode allocator steps over
every free inode deleted in the last 5 seconds, or in the last 305 while the inode table block
holding it is dirty (``recently_deleted`` in the kernel's ``fs/ext4/ialloc.c``), for every file
and folder it makes in that block group. A bench run removes its temporary folder (thousands of
folders and files) as it ends, and the next run (``make bench-ab``'s next side, or any run
started right after another) makes its files in the same block group. Measured here: 5,000
folders removed, then a ``mkdir`` cost 523 µs of CPU at once, 115 µs after ``sync`` and 6 s,
55 µs 40 s later.

``settle`` writes back everything dirty (``sync``) and waits ``SETTLE_S``, so a run does not
start inside the previous run's deletions. It lowers that cost, it doesn't remove it: a table
block the new run allocates in is dirty again, and the deleted inodes beside it count as recent
again until 305 s after their deletion. Three alternating pairs of quick loops with and without
it (docs/performance.md, "The machine") gave the executor 3,540-3,780 µs per job against
3,030-4,810 without; weak evidence, kept because the wait costs nothing measured.
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
