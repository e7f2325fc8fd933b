"""Facts read from the code, for the tests that check deploy files against it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def console_scripts() -> set[str]:
    """Every console script the workspace's packages install."""
    scripts: set[str] = set()
    for pyproject in ROOT.glob("*/*/pyproject.toml"):
        data = tomllib.loads(pyproject.read_text())
        scripts |= set(data.get("project", {}).get("scripts", {}))
    return scripts


def variables_read_by_code() -> set[str]:
    """Every ``GPULAYER_*`` name the libraries and services spell out."""
    names: set[str] = set()
    for path in list(ROOT.glob("libs/*/src/**/*.py")) + list(ROOT.glob("services/*/src/**/*.py")):
        names |= set(re.findall(r'"(GPULAYER_[A-Z0-9_]+)"', path.read_text()))
    return names
