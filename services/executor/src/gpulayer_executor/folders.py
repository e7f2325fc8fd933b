"""A job's folder and its TMPDIR on the node.

The job's folder (``<workdir>/jobs/<grant>``) is its working directory, private to its account
from its creation, kept with the job's record after the end. Inside it, ``tmp`` is the job's
``TMPDIR``: private too, and emptied at the job's end, so nothing a job (or a tool it runs,
such as torchrun's log folders) leaves in temporary files stays on the node or is seen by
another job. A TMPDIR with anything in it is moved out of the job's folder into the executor's
own ``<workdir>/trash`` (one rename) and removed from there behind the end report: once the end
is reported, the job's folder is whole and final, never half-removed under someone reading it
(a user's script, a test walking it). An empty TMPDIR (most jobs) is left where it is, with the
job's folder, until the record expires: a removal per job is a file system deletion per job, and
on ext4 without a journal every new file or folder is then made more slowly for a while (the
allocator steps over recently freed inodes), those of the next jobs included.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import time
from pathlib import Path

from gpulayer_executor.env import RunAs


def scratch_dir(cwd: Path) -> Path:
    """The job's TMPDIR, inside its folder ``cwd``."""
    return cwd / "tmp"


def prepare_job_dir(cwd: Path, run_as: RunAs | None) -> None:
    """The job's folder and its TMPDIR, private to the job's account from their creation: made
    0700 (never briefly open to others, who could keep a handle on them), then given to it."""
    # An existing one: a job started again after an executor restart, its folder made here.
    with contextlib.suppress(FileExistsError):
        cwd.mkdir(mode=0o700)
    if run_as is not None:
        os.chown(cwd, run_as.uid, run_as.gid)
    cwd.chmod(0o700)
    scratch = scratch_dir(cwd)
    with contextlib.suppress(FileExistsError):
        scratch.mkdir(mode=0o700)
    if run_as is None:
        return
    # The job's folder is the job's: on a start again, what stands at ``tmp`` may be a link it
    # made. Changed through a descriptor that never follows one; anything but a folder there
    # is left as the job made it.
    try:
        fd = os.open(scratch, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        os.fchown(fd, run_as.uid, run_as.gid)
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def empty_trash(trash: Path) -> asyncio.Future[None] | None:
    """The removal, in a thread, of what an earlier run left in the executor's trash folder
    (stopped in the middle of a removal): None when there is nothing."""
    try:
        left = list(trash.iterdir())
    except FileNotFoundError:
        return None
    if not left:
        return None
    loop = asyncio.get_running_loop()
    return loop.run_in_executor(None, functools.partial(_remove_all, left))


def _nothing_in(path: Path) -> bool:
    """Nothing stands at ``path``, or an empty folder (not a link to one) does."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    except OSError:  # a link, a file, or a folder we may not read: taken away
        return False
    try:
        with os.scandir(fd) as entries:
            return next(entries, None) is None
    finally:
        os.close(fd)


def _remove_all(paths: list[Path]) -> None:
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def clear_scratch(cwd: Path, trash: Path) -> asyncio.Future[None] | None:
    """Empty the job's TMPDIR: when it is an empty folder (most jobs), nothing is done (see the
    module's docstring). Else it is renamed into ``trash`` (the executor's, on the same file
    system) at once and removed from there in a thread behind the job's end report, so a job
    that left a million files doesn't hold its report (and so its devices) for the walk, and
    nobody reading the job's folder after its end sees a half-removed one. What stands at
    ``tmp`` is looked into without following a link (a link the job put there moves as a
    link), and the walk never follows one either (``shutil.rmtree`` on Linux works through
    descriptors). Returns that removal, for whoever wants to wait for it (None: nothing left
    to remove)."""
    scratch = scratch_dir(cwd)
    if _nothing_in(scratch):
        return None
    gone = trash / f"{cwd.name}-{time.time_ns()}"
    try:
        os.rename(scratch, gone)  # the entry itself: a link the job put there moves as a link
    except OSError:
        # No trash to move it to (removed under the executor): removed in place, before the
        # report, so the job's folder is still final when its end is known.
        _remove_all([scratch])
        return None
    loop = asyncio.get_running_loop()
    return loop.run_in_executor(None, functools.partial(_remove_all, [gone]))
