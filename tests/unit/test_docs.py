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


# A page of docs/ is a reference: what holds now, and how it is measured. How the work went
# (who tried what in which sitting, what was left for later) is git log's. Each pattern is a
# way a page tells that story. The technical senses of the same words don't match: a process's
# or a database's session ("its own session", "another session", "the same session"), a round
# trip, rounds of a measurement ("three rounds each"), a job's attempt ("the first attempt",
# "the next attempt": gpulayer's word for a job's run).
_ORDINAL = (
    r"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth"
    r"|\d+(?:st|nd|rd|th))"
)
_DIARY = [
    (
        rf"\b(?:this|last|earlier|previous|prior|next|later|{_ORDINAL})(?:'s)?\s+"
        r"(?:session|round)s?\b(?!\s+trips?\b)",
        "a work session or round",
    ),
    (r"\b(?:session|round)\s+\d+\b", "a numbered session or round"),
    (r"\b(?:the|a) (?:session|round) (?:before|after)\b", "a session or round before/after"),
    (r"^#{1,6}\s.*\b\d{4}-\d{2}-\d{2}\b", "a dated heading"),
    (r"^\s*(?:[-*]|\d+\.)\s+(?:\*\*)?\d{4}-\d{2}-\d{2}\b", "a dated list item"),
    (r"^#{1,6}\s.*\b(?:sessions?|rounds?|attempt \d+)\b", "a heading naming a session"),
    (r"^#{1,6}\s.*\bwhere it st(?:ands|ood)\b", "a heading on where the work stood"),
    (r"\b(?:an?|the) earlier (?:run|measurement|profile)s?\b", "an earlier run"),
    (r"\bissue \d+(?:'s)? (?:is )?still open\b", "an issue's standing"),
    (r"\b(?:was|were) tried in\b", "when something was tried"),
    (r"\blast note\b", "a note to the next reader of the diary"),
    (r"\bwe (?:tried|measured|found|cut|changed|decided|kept|dropped|landed|reverted)\b", "we did"),
    (r"\b(?:left|sized) for (?:the next|a later|later|next)\b", "work left for later"),
    (r"\bnot landed\b", "work not landed"),
    (r"\bwhat was (?:cut|fixed)\b", "what was done"),
    (r"\bwhat changed to get here\b", "how the figures came about"),
    (r"\b(?:later|this round's|this session's) cuts\b", "cuts in order of work"),
]


def _doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("**/*.md"))]


def test_docs_tell_no_work_history() -> None:
    patterns = [(re.compile(p, re.IGNORECASE), what) for p, what in _DIARY]
    found = []
    for page in _doc_pages():
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for pattern, what in patterns:
                if pattern.search(line):
                    found.append(f"{page.relative_to(ROOT)}:{number}: {what}: {line.strip()}")
    assert not found, (
        "docs read as a diary (say what holds now; git log has the history):\n" + "\n".join(found)
    )


def test_performance_opens_with_its_figures() -> None:
    lines = (DOCS / "performance.md").read_text().splitlines()
    assert lines[0].startswith("# "), "docs/performance.md: the title first"
    first_table = next(i for i, line in enumerate(lines) if line.startswith("|"))
    sections = [i for i, line in enumerate(lines) if line.startswith("## ")]
    assert not sections or first_table < sections[0], (
        f"docs/performance.md: its figures table (line {first_table + 1}) comes after a section "
        f"(line {sections[0] + 1}): the table goes right under the title"
    )
    prose = [line for line in lines[1:first_table] if line.strip()]
    assert len(prose) <= 4, f"docs/performance.md: {len(prose)} lines before the figures table"
    header = lines[first_table].lower()
    for column in ("figure", "value", "commit", "date", "anchor"):
        assert column in header, f"docs/performance.md: the figures table has no {column} column"
