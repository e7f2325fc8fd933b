"""gpulayer-web's settings: loopback by default, bad values named, a non-viewer credential
refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpulayer_runtime.auth import AuthStore
from gpulayer_runtime.settings import ConfigError, NatsSettings
from gpulayer_web.__main__ import caller_of, read_settings


def test_defaults_bind_loopback() -> None:
    _, web = read_settings({})
    assert (web.host, web.port) == ("127.0.0.1", 8470)
    assert "*" not in web.allowed_hosts
    assert "localhost" in web.allowed_hosts


def test_binding_elsewhere() -> None:
    _, web = read_settings({"GPULAYER_WEB_HOST": "0.0.0.0", "GPULAYER_WEB_PORT": "0"})
    assert web.allowed_hosts == ("*",)
    assert web.port == 0
    _, web = read_settings(
        {"GPULAYER_WEB_HOST": "0.0.0.0", "GPULAYER_WEB_ALLOWED_HOSTS": "fleet.example, x"}
    )
    assert web.allowed_hosts == ("fleet.example", "x")


@pytest.mark.parametrize(
    ("name", "value"),
    [("GPULAYER_WEB_PORT", "70000"), ("GPULAYER_WEB_PORT", "http"),
     ("GPULAYER_WEB_REFRESH_S", "nan-ish"), ("GPULAYER_WEB_REFRESH_S", "-1"),
     ("GPULAYER_WEB_JOBS", "0")],
)  # fmt: skip
def test_bad_values_are_named(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=name):
        read_settings({name: value})


def test_only_a_viewer_credential_is_taken(tmp_path: Path) -> None:
    store = AuthStore(tmp_path / "auth").init()
    viewer = NatsSettings(creds=str(store.mint("viewer", "board")))
    assert caller_of(viewer) == "board"
    assert caller_of(NatsSettings()) == "anonymous"
    for role, name in (("user", "alice"), ("admin", "ops"), ("node", "n1")):
        with pytest.raises(ConfigError, match=f"its role is {role}"):
            caller_of(NatsSettings(creds=str(store.mint(role, name))))  # type: ignore[arg-type]
