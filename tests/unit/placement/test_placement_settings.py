"""``gpulayer-placement`` settings read from the environment at start: a bad value stops
placement naming the variable and the value, before it connects to anything."""

from __future__ import annotations

import pytest

from gpulayer_placement.__main__ import admin_names, read_settings, rendezvous_ports, status_hold
from gpulayer_runtime.settings import ConfigError


@pytest.mark.parametrize(
    ("raw", "ports"),
    [
        ("29500-29999", (29500, 29999)),
        (" 29500 - 29999 ", (29500, 29999)),
        ("29500", (29500, 29500)),  # one port: one distributed job per node at a time
        ("1024-65535", (1024, 65535)),
    ],
)
def test_rendezvous_ports(raw: str, ports: tuple[int, int]) -> None:
    assert rendezvous_ports(raw) == ports


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        ("", "is not FIRST-LAST"),
        ("ports", "is not FIRST-LAST"),
        ("29500-", "is not FIRST-LAST"),
        ("-29500", "is not FIRST-LAST"),
        ("29500-29600-29700", "is not FIRST-LAST"),
        ("29500.5-29600", "is not FIRST-LAST"),
        ("29999-29500", "want 1024 <= FIRST <= LAST <= 65535"),  # reversed: no port at all
        ("80-90", "want 1024 <= FIRST <= LAST <= 65535"),  # privileged ports
        ("0-0", "want 1024 <= FIRST <= LAST <= 65535"),
        ("60000-70000", "want 1024 <= FIRST <= LAST <= 65535"),
    ],
)
def test_rendezvous_ports_refused(raw: str, why: str) -> None:
    with pytest.raises(ConfigError, match="GPULAYER_RENDEZVOUS_PORTS") as err:
        rendezvous_ports(raw)
    assert why in str(err.value)
    assert repr(raw) in str(err.value)


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        ("9" * 100_000 + "-1", "is not FIRST-LAST"),  # int() refuses over 4,300 digits
        ("9" * 4_000, "want 1024 <= FIRST <= LAST"),  # a number, far out of range
    ],
)
def test_a_huge_rendezvous_value_is_refused_in_a_short_message(raw: str, why: str) -> None:
    # The message quotes only the start of the value.
    with pytest.raises(ConfigError, match=why) as err:
        rendezvous_ports(raw)
    assert len(str(err.value)) < 200


def test_admin_names() -> None:
    assert admin_names("admin") == {"admin"}
    assert admin_names(" alice, bob ,,") == {"alice", "bob"}
    assert admin_names("") == frozenset()


@pytest.mark.parametrize("name", ["ops.team", "ops*", "ops>", "two words", "a\tb"])
def test_admin_names_refuse_what_a_subject_token_cannot_hold(name: str) -> None:
    with pytest.raises(ConfigError) as err:
        admin_names(f"admin,{name}")
    assert str(err.value) == f"GPULAYER_ADMINS: {name!r} is not a valid identity name"


def test_status_hold_defaults_to_50_ms_and_0_turns_it_off() -> None:
    assert read_settings({}).status_hold_s == 0.05
    assert read_settings({"GPULAYER_STATUS_HOLD_S": "0"}).status_hold_s == 0.0
    assert status_hold(" 0.2 ") == 0.2
    assert status_hold("1") == 1.0


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        ("soon", "expected a number"),
        ("", "expected a number"),
        ("-0.1", "expected a number from 0 to 1"),
        ("1.5", "expected a number from 0 to 1"),
        ("nan", "expected a number from 0 to 1"),
        ("inf", "expected a number from 0 to 1"),
        ("1e308", "expected a number from 0 to 1"),
    ],
)
def test_a_bad_status_hold_names_the_variable(raw: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why) as err:
        status_hold(raw)
    assert "GPULAYER_STATUS_HOLD_S" in str(err.value)
