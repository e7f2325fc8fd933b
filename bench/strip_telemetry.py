"""A copy of the placement service with its telemetry code removed, for the A/B figure.

Issue 5 asks that, with no OTLP endpoint, placement runs as fast as it would with the telemetry
code taken out of the path. This module takes it out: it copies ``gpulayer_placement`` and
rewrites each of its modules with every telemetry branch folded as if telemetry were off
(``if tel``, ``if self.tel.enabled ...``, ``x if tel else y``) and every ``self.tel.*(...)``
statement deleted. Telemetry lives in several of the service's parts (intake, scheduler,
publisher, status, ...), so every module is rewritten, and none may keep any.
The bench then runs that copy (first on PYTHONPATH) beside the real one.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import shutil
from pathlib import Path


def _is_tel(node: ast.AST) -> bool:
    """``tel`` or ``self.tel`` or anything reached through them (``self.tel.enabled``,
    ``self.tel.tracer.start_span(...).end``)."""
    while isinstance(node, ast.Attribute | ast.Call):
        if isinstance(node, ast.Call):
            node = node.func  # self.tel.tracer.start_span(...).end
            continue
        if isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr == "tel":
            return True
        node = node.value
    return isinstance(node, ast.Name) and node.id == "tel"


def _truth(test: ast.expr) -> bool | None:
    """The test's value with telemetry off, or None when it doesn't depend on telemetry."""
    if _is_tel(test):
        return False
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = _truth(test.operand)
        return None if inner is None else not inner
    if isinstance(test, ast.BoolOp):
        values = [_truth(v) for v in test.values]
        if isinstance(test.op, ast.And) and False in values:
            return False
        if isinstance(test.op, ast.Or) and True in values:
            return True
    return None


def _blocks(node: ast.AST) -> list[str]:
    """The fields of ``node`` that hold a block of statements and have some."""
    return [
        field
        for field, value in ast.iter_fields(node)
        if isinstance(value, list) and value and isinstance(value[0], ast.stmt)
    ]


class _Strip(ast.NodeTransformer):
    def generic_visit(self, node: ast.AST) -> ast.AST:
        # Every visit_* goes through here, so this is the one place a block can lose its last
        # statement (a ``for`` whose body was only ``self.tel.gauge(...)`` calls): Python has no
        # empty block, so one that had statements keeps a ``pass``.
        blocks = _blocks(node)
        super().generic_visit(node)
        for field in blocks:
            if not getattr(node, field):
                setattr(node, field, [ast.Pass()])
        return node

    def visit_If(self, node: ast.If) -> ast.AST | list[ast.stmt]:
        self.generic_visit(node)
        truth = _truth(node.test)
        if truth is None:
            return node
        return (node.body if truth else node.orelse) or [ast.Pass()]

    def visit_IfExp(self, node: ast.IfExp) -> ast.AST:
        self.generic_visit(node)
        truth = _truth(node.test)
        if truth is None:
            return node
        return node.body if truth else node.orelse

    def visit_Expr(self, node: ast.Expr) -> ast.AST | None:
        self.generic_visit(node)
        call = node.value
        if isinstance(call, ast.Call) and _is_tel(call.func):
            return None  # self.tel.count(...), self.tel.record(...)
        return node

    def visit_Assign(self, node: ast.Assign) -> ast.AST | None:
        self.generic_visit(node)
        if _is_tel(node.value) and all(isinstance(t, ast.Name) for t in node.targets):
            return None  # tel = self.tel.enabled
        return node


def strip(source: str) -> tuple[str, int]:
    """``source`` without telemetry code, and how many statements/branches were removed."""
    tree = ast.parse(source)
    before = sum(1 for _ in ast.walk(tree))
    tree = ast.fix_missing_locations(_Strip().visit(tree))
    after = sum(1 for _ in ast.walk(tree))
    return ast.unparse(tree), before - after


def stripped_placement(dest: Path) -> tuple[Path, int]:
    """Copy gpulayer_placement under ``dest`` with telemetry removed from every module.
    Returns the folder to put first on PYTHONPATH and the number of AST nodes removed."""
    spec = importlib.util.find_spec("gpulayer_placement")
    assert spec is not None
    assert spec.submodule_search_locations
    src = Path(next(iter(spec.submodule_search_locations)))
    target = dest / "gpulayer_placement"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__"))
    total = 0
    for module in sorted(target.rglob("*.py")):
        text, removed = strip(module.read_text())
        # Each part keeps the telemetry its constructor is given, unused once stripped.
        if re.search(r"\btel\b", text.replace("self.tel = telemetry", "")):
            raise RuntimeError(f"telemetry code left in the stripped placement {module.name}")
        compile(text, str(module), "exec")
        module.write_text(text)
        total += removed
    return dest, total
