"""Numbers in settings and command-line options: one parser (``parse_number``) behind every
one of them, so ``nan``, ``inf`` and ``1e400`` (which ``float()`` takes) are refused alike."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from tests.helpers import TEST_SIGNER

from gpulayer_cli.main import build_parser
from gpulayer_detection.cli import _parser as probe_parser
from gpulayer_executor.__main__ import settings as executor_settings
from gpulayer_placement.__main__ import read_settings as placement_settings
from gpulayer_probe.__main__ import read_settings as probe_settings
from gpulayer_runtime.settings import (
    ConfigError,
    env_float,
    number_option,
    parse_number,
    setting_number,
)
from gpulayer_web.__main__ import read_settings as web_settings

NOT_NUMBERS = ("nan", "NaN", "inf", "-inf", "1e400", "-1", "", "soon")


@pytest.mark.parametrize("raw", NOT_NUMBERS)
def test_parse_number_refuses_what_is_not_a_positive_finite_number(raw: str) -> None:
    with pytest.raises(ValueError, match="expected a number above 0"):
        parse_number(raw)


def test_parse_number_bounds() -> None:
    assert parse_number(" 2.5 ") == 2.5
    assert parse_number("1e3") == 1000.0
    assert parse_number("0", low_open=False) == 0.0
    assert parse_number("-1", low=-1, low_open=False) == -1.0
    with pytest.raises(ValueError, match=r"expected a number above 0$"):
        parse_number("0")
    with pytest.raises(ValueError, match=r"expected a number from 0 to 1$"):
        parse_number("1.5", low_open=False, high=1)
    with pytest.raises(ValueError, match=r"expected a number above 0 and at most 60$"):
        parse_number("61", high=60)
    with pytest.raises(ValueError, match=r"expected a number of -1 or more$"):
        parse_number("-2", low=-1, low_open=False)


def test_a_setting_error_names_the_setting() -> None:
    assert env_float({}, "X_S", 3.0) == 3.0
    assert env_float({"X_S": " "}, "X_S", 3.0) == 3.0
    with pytest.raises(ConfigError, match=r"^X_S='nan': expected a number above 0$"):
        env_float({"X_S": "nan"}, "X_S", 3.0)
    with pytest.raises(ConfigError, match=r"^X_S='1e400': expected a number from 0 to 1$"):
        setting_number("X_S", "1e400", low_open=False, high=1)


def _executor(env: Mapping[str, str]) -> Any:
    keys = {"GPULAYER_PLACEMENT_PUBLIC_KEYS": TEST_SIGNER.public_key}
    return executor_settings({"GPULAYER_NODE_ID": "n1", **keys, **env}, euid=4321)


# Every number a service reads from its environment, with the reader that reads it.
SETTINGS: list[tuple[Callable[[Mapping[str, str]], Any], str]] = [
    *(
        (probe_settings, name)
        for name in (
            "GPULAYER_PROBE_REFRESH_S",
            "GPULAYER_PROBE_REPUBLISH_S",
            "GPULAYER_HEARTBEAT_S",
            "GPULAYER_PROBE_TIMEOUT_S",
            "GPULAYER_PROBE_TORCH_TIMEOUT_S",
            "GPULAYER_PROBE_OBSERVE_S",
            "GPULAYER_DOCTOR_RATE",
            "GPULAYER_PROBE_CONTAINER_TEST_S",
        )
    ),
    (web_settings, "GPULAYER_WEB_REFRESH_S"),
    *(
        (placement_settings, name)
        for name in (
            "GPULAYER_NODE_TIMEOUT_S",
            "GPULAYER_GRANT_RESEND_S",
            "GPULAYER_SUBMIT_RATE",
            "GPULAYER_API_RATE",
            "GPULAYER_STATUS_HOLD_S",
        )
    ),
    *(
        (_executor, name)
        for name in (
            "GPULAYER_KILL_GRACE_S",
            "GPULAYER_HEARTBEAT_S",
            "GPULAYER_EXECUTOR_DRAIN_S",
            "GPULAYER_EXECUTOR_RESERVED_CORES",
            "GPULAYER_EXECUTOR_RESERVED_MEMORY_GB",
            "GPULAYER_EXECUTOR_CONTAINER_PULL_TIMEOUT_S",
            "GPULAYER_GRANT_MAX_AGE_S",
        )
    ),
]


@pytest.mark.parametrize("raw", ["nan", "inf", "-1", "1e400"])
@pytest.mark.parametrize(("read", "name"), SETTINGS, ids=[name for _, name in SETTINGS])
def test_every_number_setting_refuses_non_finite_and_negative_values(
    read: Callable[[Mapping[str, str]], Any], name: str, raw: str
) -> None:
    with pytest.raises(ConfigError, match=rf"^{name}='{raw}': expected a number"):
        read({name: raw})


def test_settings_that_may_be_zero() -> None:
    config = _executor(
        {"GPULAYER_EXECUTOR_DRAIN_S": "0.0", "GPULAYER_EXECUTOR_RESERVED_CORES": "0"}
    )
    assert (config.drain_s, config.reserved_cores) == (0.0, 0.0)
    assert placement_settings({"GPULAYER_STATUS_HOLD_S": "0"}).status_hold_s == 0.0


# Every number option of the command line: (parser, argv before the value, its dest).
OPTIONS: list[tuple[Callable[[], argparse.ArgumentParser], tuple[str, ...], str]] = [
    (probe_parser, ("--timeout",), "timeout"),
    (probe_parser, ("--torch-timeout",), "torch_timeout"),
    (build_parser, ("doctor", "n1", "--timeout"), "timeout"),
    (build_parser, ("dev", "up", "--timeout"), "timeout"),
]


@pytest.mark.parametrize("raw", ["nan", "inf", "-1", "1e400", "0"])
@pytest.mark.parametrize(
    ("parser", "argv", "dest"), OPTIONS, ids=[" ".join(a) for _, a, _ in OPTIONS]
)
def test_every_timeout_option_refuses_what_is_not_a_positive_finite_number(
    parser: Callable[[], argparse.ArgumentParser],
    argv: tuple[str, ...],
    dest: str,
    raw: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert getattr(parser().parse_args([*argv, "2.5"]), dest) == 2.5
    with pytest.raises(SystemExit) as exit_:
        parser().parse_args([*argv, raw])
    assert exit_.value.code == 2
    assert f"{argv[-1]}: '{raw}': expected a number above 0" in capsys.readouterr().err


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "1e400", "-2"])
def test_quota_cores_takes_minus_one_to_clear_and_no_other_non_number(
    raw: str, capsys: pytest.CaptureFixture[str]
) -> None:
    quota = ("quota", "set", "alice", "--cores")
    assert build_parser().parse_args([*quota, "-1"]).cores == -1.0
    assert build_parser().parse_args([*quota, "8"]).cores == 8.0
    with pytest.raises(SystemExit):
        build_parser().parse_args([*quota, raw])
    assert "--cores: " in capsys.readouterr().err


def test_number_option_is_an_argparse_type() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--x", type=number_option(high=10))
    assert p.parse_args(["--x", "10"]).x == 10.0


def test_no_option_parses_its_number_with_float_alone() -> None:
    # argparse's type=float takes nan, inf and 1e400: every number option goes through
    # number_option instead.
    root = Path(__file__).resolve().parents[2]
    found = [
        f"{path.relative_to(root)}:{n}"
        for top in ("libs", "services", "bench")
        for path in sorted((root / top).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "type=float" in line.replace(" ", "")
    ]
    assert found == []
