"""deploy/compose.yaml fits the code: commands exist, variables are read, paths exist."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _console_scripts() -> set[str]:
    scripts: set[str] = set()
    for pyproject in ROOT.glob("*/*/pyproject.toml"):
        data = tomllib.loads(pyproject.read_text())
        scripts |= set(data.get("project", {}).get("scripts", {}))
    return scripts


def _variables_read_by_code() -> set[str]:
    names: set[str] = set()
    for path in list(ROOT.glob("libs/*/src/**/*.py")) + list(ROOT.glob("services/*/src/**/*.py")):
        names |= set(re.findall(r'"(GPULAYER_[A-Z0-9_]+)"', path.read_text()))
    return names


def _compose() -> dict:  # type: ignore[type-arg]
    return yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())


def test_every_service_command_is_a_console_script() -> None:
    scripts = _console_scripts()
    services = _compose()["services"]
    ours = {name: s for name, s in services.items() if str(s.get("image", "")).startswith("gpulayer")}
    assert {"placement", "probe", "executor"} <= set(ours)
    for name, svc in ours.items():
        assert svc["command"][0] in scripts, f"{name}: {svc['command'][0]} is not a console script"


def test_every_variable_is_one_the_code_reads() -> None:
    read = _variables_read_by_code()
    for name, svc in _compose()["services"].items():
        for var in svc.get("environment", {}) or {}:
            if var.startswith("GPULAYER_"):
                assert var in read, f"{name}: {var} is not read by any service"


def test_build_paths_exist() -> None:
    for svc in _compose()["services"].values():
        build = svc.get("build")
        if build:
            context = (ROOT / "deploy" / build["context"]).resolve()
            assert context == ROOT
            assert (context / build["dockerfile"]).is_file()


def test_makefile_and_ci_call_the_readme_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "make run" in readme
    assert "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    makefile = (ROOT / "Makefile").read_text()
    for target in ("run:", "test:", "lint:", "bench:"):
        assert f"\n{target}" in makefile
