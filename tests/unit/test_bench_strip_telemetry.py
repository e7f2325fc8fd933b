"""The telemetry A/B's rewrite (bench/strip_telemetry.py): every module it rewrites still
compiles and still defines what it defined, and the stripped package imports as the bench runs
it. Issue 30: a ``for`` whose body was only ``self.tel.gauge(...)`` calls came out empty, so the
copy of metrics.py was not Python and ``make bench`` stopped there."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench.strip_telemetry import strip, stripped_placement

_spec = importlib.util.find_spec("gpulayer_placement")
assert _spec is not None
assert _spec.submodule_search_locations
PLACEMENT = Path(next(iter(_spec.submodule_search_locations)))
MODULES = sorted(PLACEMENT.rglob("*.py"))


def _definitions(tree: ast.Module) -> dict[str, list[str]]:
    """Each top-level def, class and assigned name, with a class's own defs and attributes."""
    out: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            out[node.name] = []
        elif isinstance(node, ast.ClassDef):
            out[node.name] = sorted(
                n.name if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) else ast.unparse(n)
                for n in node.body
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.AnnAssign)
            )
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                out[ast.unparse(t)] = []
    return out


def test_the_package_has_modules_to_rewrite() -> None:
    assert PLACEMENT.name == "gpulayer_placement"
    assert any(m.name == "metrics.py" for m in MODULES)


_REWRITE_ALL = """
import ast, json, sys
from pathlib import Path
from bench.strip_telemetry import strip
from tests.unit.test_bench_strip_telemetry import _definitions
out = {}
for name in sys.argv[1:]:
    source = Path(name).read_text()
    try:
        text, removed = strip(source)
        tree = ast.parse(text, name)
        compile(tree, name, "exec")
        same = _definitions(tree) == _definitions(ast.parse(source))
        out[name] = {"removed": removed, "same_definitions": same}
    except Exception as err:
        out[name] = {"error": f"{type(err).__name__}: {err}"}
json.dump(out, sys.stdout)
"""


@pytest.fixture(scope="module")
def rewritten() -> dict[str, dict[str, object]]:
    """Every module rewritten in an interpreter of its own: CPython 3.11.7's AST constructor
    keeps a recursion count that an earlier failed parse anywhere in the process can leave off
    (gh-106905, fixed in 3.11.8), and then ``ast.parse`` of any source raises SystemError (a
    pytest worker that ran other tests first did, once)."""
    done = subprocess.run(
        [sys.executable, "-c", _REWRITE_ALL, *map(str, MODULES)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=Path(__file__).parents[2],
    )
    out: dict[str, dict[str, object]] = json.loads(done.stdout)
    return out


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.name)
def test_each_rewritten_module_compiles_and_keeps_its_definitions(
    module: Path, rewritten: dict[str, dict[str, object]]
) -> None:
    assert rewritten[str(module)] == {
        "removed": rewritten[str(module)].get("removed"),
        "same_definitions": True,
    }
    removed = rewritten[str(module)]["removed"]
    assert isinstance(removed, int)
    assert removed >= 0


def test_a_block_left_empty_keeps_a_pass() -> None:
    source = (
        "class G:\n"
        "    def register(self):\n"
        "        for name in NAMES:\n"
        "            self.tel.gauge(name, lambda: 1)\n"
        "        self.after = 1\n"
        "    def only_tel(self):\n"
        "        self.tel.count('x')\n"
        "    def branch(self, tel):\n"
        "        if ready:\n"
        "            x = 1\n"
        "        else:\n"
        "            self.tel.record(2)\n"
        "        with lock:\n"
        "            self.tel.count('y')\n"
        "        try:\n"
        "            self.tel.count('z')\n"
        "        finally:\n"
        "            self.tel.count('w')\n"
    )
    text, removed = strip(source)
    compile(text, "<stripped>", "exec")
    assert "self.tel" not in text
    assert removed > 0
    tree = ast.parse(text)
    register = next(n for n in ast.walk(tree) if isinstance(n, ast.For))
    assert [type(s) for s in register.body] == [ast.Pass]
    # Blocks that were empty to begin with (a ``for`` with no ``else``) stay empty.
    assert register.orelse == []


_NAMESPACES = """
import importlib, inspect, json, pkgutil, sys
import gpulayer_placement as pkg
out = {"file": pkg.__file__, "modules": {}}
for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
    mod = importlib.import_module(info.name)
    out["modules"][info.name] = {
        name: sorted(vars(value)) if inspect.isclass(value) else []
        for name, value in vars(mod).items()
        if not name.startswith("__")
    }
json.dump(out, sys.stdout)
"""


def _namespaces(pythonpath: str | None) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    done = subprocess.run(
        [sys.executable, "-c", _NAMESPACES],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    out: dict[str, object] = json.loads(done.stdout)
    return out


def test_the_stripped_package_imports_with_every_name_its_callers_use(tmp_path: Path) -> None:
    """As the bench runs it (first on PYTHONPATH): every module imports and binds the same
    names, each class the same attributes, as the real package."""
    folder, removed = stripped_placement(tmp_path)
    assert removed > 0
    real = _namespaces(None)
    cut = _namespaces(str(folder))
    assert Path(str(cut["file"])).is_relative_to(tmp_path)
    assert not Path(str(real["file"])).is_relative_to(tmp_path)
    assert cut["modules"] == real["modules"]
