"""What torchrun says of a failed run: the worker that failed first, from the summary it prints
on its stderr before it exits 1 (whatever the worker's own code was). Pure."""

from __future__ import annotations

import re
import signal

# torchrun's summary of a failed run, printed on its stderr as it exits 1 (torch's
# ``_MSG_FORMAT_TEMPLATE`` / ``_FAILURE_FORMAT_TEMPLATE``, the same since torch 1.9):
#   Root Cause (first observed failure):
#   [0]:
#     ...
#     rank      : 3 (local_rank: 1)
#     exitcode  : 3 (pid: 1234)        or  -9 (pid: 1234) Signal 9 (SIGKILL) received by PID 1234
_ROOT_CAUSE = "Root Cause (first observed failure):"
_RANK = re.compile(r"^\s*rank\s*:\s*(\d{1,9}) \(local_rank: (\d{1,9})\)\s*$")
_EXITCODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d{1,9}) \(pid: \d{1,10}\)")


class RootCause:
    """Reads a job's stderr lines as they go by and keeps the worker that failed first, from
    torchrun's closing summary: a rank run under torchrun, or any job that runs torchrun itself
    (single-node training mostly does), exits 1 whatever its worker did. The lines are the
    job's own (it could print a summary of its own making): what is kept only ever adds to its
    own job's reason, bounded."""

    __slots__ = ("_in", "exit_code", "local_rank", "rank")

    def __init__(self) -> None:
        self._in = False
        self.rank: int | None = None
        self.local_rank: int | None = None
        self.exit_code: int | None = None

    def feed(self, line: str) -> None:
        if len(line) > 512:
            return
        if _ROOT_CAUSE in line:
            self._in, self.rank, self.local_rank, self.exit_code = True, None, None, None
            return
        if not self._in:
            return
        if m := _RANK.match(line):
            self.rank, self.local_rank = int(m[1]), int(m[2])
        elif m := _EXITCODE.match(line):
            self.exit_code = int(m[1])
        elif line.startswith("====="):
            self._in = False

    def summary(self) -> str | None:
        """``torchrun: its worker of global rank 3 (local 1) exited with code 3``, or None."""
        if self.rank is None or self.exit_code is None:
            return None
        worker = f"torchrun: its worker of global rank {self.rank} (local {self.local_rank})"
        if self.exit_code >= 0:
            return f"{worker} exited with code {self.exit_code}"
        try:
            name = signal.Signals(-self.exit_code).name
        except ValueError:
            name = f"signal {-self.exit_code}"
        return f"{worker} was killed by {name}"
