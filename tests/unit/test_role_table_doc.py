"""The role table (``gpulayer_cli.role_table``) covers every command, API verb and role, and
docs/security.md shows it as the code has it (tests/e2e/test_role_table.py walks it)."""

from __future__ import annotations

import argparse
from pathlib import Path

from gpulayer_cli.common import EXIT_DENIED, EXIT_FAILED, EXIT_INVALID, EXIT_UNREACHABLE
from gpulayer_cli.main import build_parser
from gpulayer_cli.role_table import ROLES_SHOWN, TABLE, markdown
from gpulayer_contracts.subjects import API_VERBS
from gpulayer_runtime.roles import ROLES

DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"


def test_every_command_has_a_row() -> None:
    parser = build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    in_table = {r.command.split()[0] for r in TABLE if r.kind == "cli"}
    assert set(sub.choices) == in_table


def test_every_api_verb_has_a_row() -> None:
    in_table = {f"gpulayer.api.{r.command.split()[0]}" for r in TABLE if r.kind == "api"}
    assert set(API_VERBS) == in_table


def test_every_role_a_person_holds_has_a_column() -> None:
    # placement's credential is the service's own; a new role (a read-only one) needs a column.
    assert set(ROLES_SHOWN) == set(ROLES) - {"placement"}
    assert all(r.outcome(role) for r in TABLE for role in ROLES_SHOWN)


def test_cases_are_unique() -> None:
    cases = [r.case for r in TABLE]
    assert len(cases) == len(set(cases))


def test_the_denied_status_is_its_own() -> None:
    assert EXIT_DENIED not in (0, EXIT_FAILED, EXIT_INVALID, EXIT_UNREACHABLE, 130)


def test_security_doc_shows_the_table_as_the_code_has_it() -> None:
    text = DOC.read_text()
    assert markdown() in text, (
        "docs/security.md: the role table differs from gpulayer_cli.role_table; paste the "
        "output of `python -m gpulayer_cli.role_table`"
    )
    assert f"exit status {EXIT_DENIED}" in text
