"""Summarise a py-spy ``--format raw`` (collapsed stacks) file: where the time went.

``python -m bench.pyspy_summary FILE [N]``: the N functions with the most samples on top of
the stack (self) and anywhere on it (inclusive), as shares of all samples. Idle samples (the
event loop waiting in ``select``) are counted and shown as their own line.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

_FRAME = re.compile(r"^(?P<fn>[^ ]+) \((?P<file>[^:]+)(?::(?P<line>\d+))?\)$")
_IDLE = ("EpollSelector.select (selectors.py", "select (selectors.py")


def _short(frame: str) -> str:
    """``fn (path/to/file.py:12)`` -> ``file.py:fn``; line numbers merged."""
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    file = m["file"]
    parts = file.split("/")
    if "site-packages" in parts:
        parts = parts[parts.index("site-packages") + 1 :]
    return f"{'/'.join(parts[-2:])}:{m['fn']}"


def summarise(text: str, top: int = 25) -> str:
    self_c: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = idle = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [f for f in stack.split(";") if f and not f.startswith("process ")]
        total += n
        if frames and any(frames[-1].startswith(i) for i in _IDLE):
            idle += n
            continue
        short = [_short(f) for f in frames]
        if short:
            self_c[short[-1]] += n
        for name in set(short):
            incl[name] += n
    if not total:
        return "no samples"
    out = [f"samples: {total}, idle in the event loop: {100 * idle / total:.1f}%", "", "self:"]
    out += [f"  {100 * c / total:5.1f}%  {name}" for name, c in self_c.most_common(top)]
    out += ["", "inclusive:"]
    out += [f"  {100 * c / total:5.1f}%  {name}" for name, c in incl.most_common(top)]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    top = int(argv[1]) if len(argv) > 1 else 25
    print(summarise(Path(argv[0]).read_text(), top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
