"""``gpulayer-executor`` settings from an environment mapping."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from gpulayer_executor.__main__ import settings
from gpulayer_runtime.settings import ConfigError


def test_defaults() -> None:
    config = settings({"GPULAYER_NODE_ID": "n1", "PATH": "/bin", "HOME": "/home/x"})
    assert config.node_id == "n1"
    assert config.workdir == Path(".gpulayer/executor/n1").resolve()
    assert (config.kill_grace_s, config.max_jobs, config.drain_s) == (5.0, 64, 0.0)
    assert config.run_as is None
    assert config.base_env["PATH"] == "/bin"
    assert config.base_env["HOME"] == "/home/x"


def test_overrides() -> None:
    config = settings(
        {
            "GPULAYER_NODE_ID": "n1",
            "GPULAYER_EXECUTOR_WORKDIR": "/tmp/wd",
            "GPULAYER_KILL_GRACE_S": "0.5",
            "GPULAYER_EXECUTOR_MAX_JOBS": "3",
            "GPULAYER_EXECUTOR_DRAIN_S": "30",
        }
    )
    assert (config.workdir, config.kill_grace_s, config.max_jobs, config.drain_s) == (
        Path("/tmp/wd"),
        0.5,
        3,
        30.0,
    )


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"GPULAYER_EXECUTOR_USER": "no-such-user-gpulayer"}, "no such user"),
        ({"GPULAYER_EXECUTOR_MAX_JOBS": "0"}, "positive integer"),
        ({"GPULAYER_KILL_GRACE_S": "soon"}, "number"),
        ({"GPULAYER_NODE_ID": "a.b"}, "may not contain"),
    ],
)
def test_bad_settings_are_config_errors(env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        settings({"GPULAYER_NODE_ID": "n1", **env})


@pytest.mark.skipif(os.getuid() != 0, reason="root is refused only when it exists by that name")
def test_root_is_not_an_unprivileged_user() -> None:
    with pytest.raises(ConfigError, match="unprivileged"):
        settings({"GPULAYER_NODE_ID": "n1", "GPULAYER_EXECUTOR_USER": "root"})


def test_the_default_node_id_is_the_host_name_up_to_its_first_dot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("socket.gethostname", lambda: "gpu-01.rack7.example.com")
    assert settings({"PATH": "/bin", "HOME": "/home/x"}).node_id == "gpu-01"
    with pytest.raises(ConfigError, match=re.escape("may not contain '.'")):
        settings({"GPULAYER_NODE_ID": "gpu-01.example", "PATH": "/bin", "HOME": "/home/x"})
