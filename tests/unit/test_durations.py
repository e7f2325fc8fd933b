"""The module times that order make test's modules (tests/durations.py, tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import _module_seconds
from tests.durations import module_seconds

REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="tests.e2e.test_cli" name="test_a" time="100.5"/>
<testcase classname="tests.e2e.test_cli" name="test_b" time="20.0"/>
<testcase classname="tests.unit.test_x.TestGroup" name="test_c" time="3.25"/>
</testsuite></testsuites>
"""


def test_times_add_up_per_module_file_classes_folded_in(tmp_path: Path) -> None:
    report = tmp_path / "report.xml"
    report.write_text(REPORT)
    assert module_seconds(str(report)) == {
        "tests/e2e/test_cli.py": 120.5,
        "tests/unit/test_x.py": 3.25,
    }


def test_the_checked_in_file_names_modules_that_exist() -> None:
    root = Path(__file__).parents[2]
    seconds = _module_seconds()
    assert seconds, "tests/module_seconds.txt is missing or empty"
    missing = [m for m in seconds if not (root / m).is_file()]
    assert not missing, f"run make test-durations: gone modules {missing}"
