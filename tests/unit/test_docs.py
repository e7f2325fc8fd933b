"""docs/ stays current: the generated reference matches the contracts, the operations and
architecture pages name every variable, metric, subject and stream the code has."""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from gpulayer_contracts.subjects import STREAMS
from gpulayer_runtime.telemetry import METRICS, prometheus_name

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _generator() -> Any:
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _render() -> str:
    return cast(Callable[[], str], _generator().render)()


def test_jobs_reference_is_current() -> None:
    expected = _render()
    current = (DOCS / "jobs.md").read_text()
    assert current == expected, "docs/jobs.md is out of date: run `make docs`"


def test_schema_files_are_current_and_linked() -> None:
    expected = cast(Callable[[], dict[str, str]], _generator().render_schemas)()
    present = {p.name: p.read_text() for p in (DOCS / "schemas").iterdir()}
    assert present == expected, "docs/schemas/ is out of date: run `make docs`"
    jobs = (DOCS / "jobs.md").read_text()
    for name in expected:
        assert f"(schemas/{name})" in jobs, f"docs/jobs.md does not link schemas/{name}"


def test_jobs_reference_names_every_job_field_and_event() -> None:
    text = (DOCS / "jobs.md").read_text()
    for field in ("job_id", "command", "requirements", "gpu_count", "sandbox", "distributed"):
        assert f"`{field}`" in text
    for tag in ("accepted", "rejected", "pending", "placed", "running", "succeeded", "failed"):
        assert f"`{tag}`" in text


def _variables_read_by_code() -> set[str]:
    names: set[str] = set()
    for path in list(ROOT.glob("libs/*/src/**/*.py")) + list(ROOT.glob("services/*/src/**/*.py")):
        names |= set(re.findall(r'"(GPULAYER_[A-Z0-9_]+)"', path.read_text()))
    return names


def test_operations_documents_every_variable() -> None:
    text = (DOCS / "operations.md").read_text()
    missing = sorted(v for v in _variables_read_by_code() if f"`{v}`" not in text)
    assert not missing, f"docs/operations.md does not mention {missing}"


def test_operations_documents_every_metric() -> None:
    text = (DOCS / "operations.md").read_text()
    for name in METRICS:
        assert f"`{name}`" in text, f"docs/operations.md: metric {name} missing"
        assert f"`{prometheus_name(name)}`" in text, (
            f"docs/operations.md: Prometheus name {prometheus_name(name)} missing"
        )


def test_architecture_names_every_stream_and_subject() -> None:
    text = (DOCS / "architecture.md").read_text()
    for spec in STREAMS:
        assert f"`{spec.name}`" in text, f"docs/architecture.md: stream {spec.name} missing"
        for subject in spec.subjects:
            shown = (
                subject.replace("node.*.", "node.<node>.")
                .replace("job.*.*.", "job.<owner>.<job>.")
                .replace("job.*.", "job.<job>.")
                .replace("submit.*", "submit.<owner>")
            )
            assert f"`{shown}`" in text, f"docs/architecture.md: subject {shown} missing"
    assert "allocations_no_double_booking" in text
    migrations = ROOT / "services/placement/src/gpulayer_placement/migrations"
    assert any("allocations_no_double_booking" in p.read_text() for p in migrations.glob("*.sql"))
