"""``gpulayer audit``'s times: a moment or a duration back from now."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from gpulayer_cli.audit_cmd import parse_when

NOW = datetime(2026, 12, 1, 18, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("text", "back"),
    [
        ("90s", 90),
        ("30m", 1800),
        ("2h", 7200),
        ("7d", 7 * 86400),
        ("1w", 7 * 86400),
        ("1.5h", 5400),
    ],
)
def test_durations_count_back_from_now(text: str, back: int) -> None:
    assert parse_when(text, NOW) == NOW - timedelta(seconds=back)


def test_times_are_utc_unless_they_say() -> None:
    assert parse_when("2026-11-30T12:00:00", NOW) == datetime(2026, 11, 30, 12, tzinfo=UTC)
    assert parse_when("2026-11-30T12:00:00+01:00", NOW) == datetime(2026, 11, 30, 11, tzinfo=UTC)


@pytest.mark.parametrize("text", ["yesterday", "-5m", "5x", "", "\x00", "9" * 400])
def test_anything_else_names_what_was_given(text: str) -> None:
    with pytest.raises(ValueError, match="neither a time"):
        parse_when(text, NOW)


def test_a_duration_past_any_time_is_bad_input() -> None:
    with pytest.raises(ValueError, match="further than any time"):
        parse_when("99999999999999d", NOW)
