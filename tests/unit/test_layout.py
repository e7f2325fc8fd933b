"""The workspace's import and size rules, read from the source (no package is imported):

- nothing under ``libs/`` imports a package under ``services/`` (pure logic stays reusable by the
  CLI and tests without pulling a service in);
- no service imports another service (they talk over NATS only);
- no module imports itself back through others (an import cycle inside a package), counting
  imports made inside functions and under ``TYPE_CHECKING`` too: a cycle hidden that way is
  still two modules that can't be understood apart;
- no module in ``libs/`` or ``services/`` is over 500 lines, no class over 400, no function
  over 60.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _packages(tier: str) -> dict[str, Path]:
    """Top-level package name -> its folder, for every workspace member in ``tier``."""
    found: dict[str, Path] = {}
    for src in sorted((ROOT / tier).glob("*/src")):
        for pkg in src.iterdir():
            if (pkg / "__init__.py").exists():
                found[pkg.name] = pkg
    return found


LIBS = _packages("libs")
SERVICES = _packages("services")


def _module_name(pkg: Path, file: Path) -> str:
    parts = [pkg.name, *file.relative_to(pkg).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(file: Path, module: str) -> Iterator[str]:
    """Every absolute module name ``file`` (module ``module``) imports, wherever the statement
    stands. ``from a import b`` yields ``a`` and ``a.b`` (``b`` may be a submodule)."""
    tree = ast.parse(file.read_text(), filename=str(file))
    is_pkg = file.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                keep = len(base) - node.level + (1 if is_pkg else 0)
                prefix = ".".join(base[:keep])
                name = f"{prefix}.{node.module}" if node.module else prefix
            else:
                name = node.module or ""
            yield name
            for alias in node.names:
                yield f"{name}.{alias.name}"


def _modules(pkgs: dict[str, Path]) -> dict[str, Path]:
    return {_module_name(pkg, f): f for pkg in pkgs.values() for f in sorted(pkg.rglob("*.py"))}


def test_the_workspace_has_the_packages_the_rules_speak_of() -> None:
    # A rule over an empty set would pass for the wrong reason.
    assert {"gpulayer_contracts", "gpulayer_matching", "gpulayer_detection", "gpulayer_cli"} <= set(
        LIBS
    )
    assert {"gpulayer_placement", "gpulayer_executor", "gpulayer_probe"} <= set(SERVICES)


def test_imports_of_reads_every_form() -> None:
    file = ROOT / "tests" / "unit" / "test_layout.py"
    assert "ast" in set(imports_of(file, "tests.unit.test_layout"))
    src = LIBS["gpulayer_cli"] / "check.py"
    found = set(imports_of(src, "gpulayer_cli.check"))
    assert "gpulayer_matching" in found
    assert "gpulayer_detection" in found


@pytest.mark.parametrize("module", sorted(_modules(LIBS)))
def test_libs_never_import_services(module: str) -> None:
    file = _modules(LIBS)[module]
    bad = sorted({name for name in imports_of(file, module) if name.split(".")[0] in SERVICES})
    assert not bad, f"{file.relative_to(ROOT)} (a library) imports service code: {bad}"


@pytest.mark.parametrize("module", sorted(_modules(SERVICES)))
def test_services_never_import_each_other(module: str) -> None:
    file = _modules(SERVICES)[module]
    own = module.split(".")[0]
    bad = sorted(
        {
            name
            for name in imports_of(file, module)
            if name.split(".")[0] in SERVICES and name.split(".")[0] != own
        }
    )
    assert not bad, f"{file.relative_to(ROOT)} ({own}) imports another service: {bad}"


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle in ``graph`` as a path that ends where it began, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_cycle_finder_finds_a_cycle_and_only_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


@pytest.mark.parametrize("package", sorted({**LIBS, **SERVICES}))
def test_no_import_cycle_inside_a_package(package: str) -> None:
    pkg = {**LIBS, **SERVICES}[package]
    modules = _modules({package: pkg})
    graph: dict[str, set[str]] = {}
    for module, file in modules.items():
        # A package's __init__ re-exporting its modules is not a cycle of theirs.
        targets = {n for n in imports_of(file, module) if n in modules and n != module}
        if file.name != "__init__.py":
            targets.discard(package)
        graph[module] = targets
    assert _cycle(graph) is None, f"import cycle in {package}: {' -> '.join(_cycle(graph) or [])}"


# Sizes past which a part is two parts (STYLE.md, lesson 12), for every module, class and
# function in libs/ and services/.
MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 400
MAX_FUNCTION_LINES = 60


def _oversized(file: Path, max_function_lines: int | None = MAX_FUNCTION_LINES) -> list[str]:
    """What in ``file`` is over its size limit; functions are only measured when
    ``max_function_lines`` is given."""
    text = file.read_text()
    found = []
    if (n := len(text.splitlines())) > MAX_MODULE_LINES:
        found.append(f"the file has {n} lines (> {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            limit: int | None = MAX_CLASS_LINES
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            limit = max_function_lines
        else:
            continue
        n = (node.end_lineno or node.lineno) - node.lineno + 1
        if limit is not None and n > limit:
            found.append(f"{node.name} has {n} lines (> {limit})")
    return found


def test_oversized_finds_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "long.py").write_text(f"def f():\n{body}\n")
    assert _oversized(tmp_path / "long.py") == [
        f"f has {MAX_FUNCTION_LINES + 1} lines (> {MAX_FUNCTION_LINES})"
    ]
    assert _oversized(tmp_path / "long.py", max_function_lines=None) == []


def test_oversized_finds_a_long_module_and_a_long_class(tmp_path: Path) -> None:
    at_limit = tmp_path / "at_limit.py"
    at_limit.write_text("".join(f"x{i} = {i}\n" for i in range(MAX_MODULE_LINES)))
    assert _oversized(at_limit, max_function_lines=None) == []
    over = tmp_path / "over.py"
    over.write_text("".join(f"x{i} = {i}\n" for i in range(MAX_MODULE_LINES + 1)))
    assert _oversized(over, max_function_lines=None) == [
        f"the file has {MAX_MODULE_LINES + 1} lines (> {MAX_MODULE_LINES})"
    ]
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_CLASS_LINES))
    (tmp_path / "cls.py").write_text(f"class C:\n{body}")
    assert _oversized(tmp_path / "cls.py", max_function_lines=None) == [
        f"C has {MAX_CLASS_LINES + 1} lines (> {MAX_CLASS_LINES})"
    ]


@pytest.mark.parametrize("module", sorted(_modules(SERVICES)))
def test_service_parts_stay_small(module: str) -> None:
    file = _modules(SERVICES)[module]
    assert not _oversized(file), f"{file.relative_to(ROOT)}: {'; '.join(_oversized(file))}"


@pytest.mark.parametrize("module", sorted(_modules(LIBS)))
def test_library_parts_stay_small(module: str) -> None:
    file = _modules(LIBS)[module]
    assert not _oversized(file), f"{file.relative_to(ROOT)}: {'; '.join(_oversized(file))}"
