"""Per-module test time from a JUnit XML report, slowest first, as ``tests/module_seconds.txt``
holds it (``make test-durations`` writes that file from a fresh run).

``make test`` hands whole modules to pytest-xdist workers (``--dist loadscope``: a module's
servers are started once). The run ends when its last module does, so the slowest modules are
sent first (tests/conftest.py orders them by this file): a two-minute module started last
would finish a minute after everything else.
"""

from __future__ import annotations

import collections
import sys
import xml.etree.ElementTree as ET


def module_seconds(junit_xml: str) -> dict[str, float]:
    seconds: dict[str, float] = collections.defaultdict(float)
    for case in ET.parse(junit_xml).iter("testcase"):
        file = case.get("file")
        classname = case.get("classname") or ""
        if not file:
            # pytest's classname is the dotted module, then the class when there is one.
            parts = classname.split(".")
            while parts and parts[-1][:1].isupper():
                parts.pop()
            file = "/".join(parts) + ".py"
        seconds[file] += float(case.get("time") or 0)
    return dict(seconds)


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/durations.py REPORT.xml > tests/module_seconds.txt")
    print("# seconds module: written by `make test-durations`, read by tests/conftest.py")
    for file, secs in sorted(module_seconds(sys.argv[1]).items(), key=lambda kv: -kv[1]):
        if secs >= 5:
            print(f"{secs:.0f} {file}")


if __name__ == "__main__":
    main()
