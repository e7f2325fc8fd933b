"""``gpulayer-executor`` settings from an environment mapping."""

from __future__ import annotations

import logging
import os
import pwd
import re
import shutil
import tempfile
from pathlib import Path

import pytest
from tests.helpers import TEST_SIGNER

from gpulayer_executor.__main__ import _say_who_runs_jobs, settings
from gpulayer_runtime.settings import ConfigError

KEYS = {"GPULAYER_PLACEMENT_PUBLIC_KEYS": TEST_SIGNER.public_key}


def test_defaults() -> None:
    # Not root: jobs run as the executor's own account (as root, see the tests below).
    config = settings(
        {"GPULAYER_NODE_ID": "n1", "PATH": "/bin", "HOME": "/home/x", **KEYS}, euid=4321
    )
    assert config.node_id == "n1"
    assert config.workdir == Path(".gpulayer/executor/n1").resolve()
    assert (config.kill_grace_s, config.max_jobs, config.drain_s) == (5.0, 64, 0.0)
    assert config.run_as is None
    assert config.base_env["PATH"] == "/bin"
    assert config.base_env["HOME"] == "/home/x"
    assert config.require_signatures
    assert config.placement_public_keys == (TEST_SIGNER.public_key,)
    assert config.grant_max_age_s == 24 * 3600
    assert (config.enforce, config.job_pids_max, config.device_dir) == (True, 4096, Path("/dev"))
    assert (config.reserved_cores, config.reserved_memory_gb) == (0.0, 1.0)


def test_container_settings(tmp_path: Path) -> None:
    podman = tmp_path / "podman"
    podman.write_text("#!/bin/sh\n")
    podman.chmod(0o755)
    base = {"GPULAYER_NODE_ID": "n1", "PATH": str(tmp_path), **KEYS}
    config = settings(base, euid=4321)
    # Found on PATH; no runc there: podman's own default runtime.
    assert (config.podman, config.container_runtime) == (str(podman), None)
    assert (config.container_network, config.container_pull_timeout_s) == ("host", 300.0)
    assert (config.cdi_dirs, config.cdi_kind) == (("/etc/cdi", "/var/run/cdi"), None)
    config = settings(
        {
            **base,
            "GPULAYER_EXECUTOR_CONTAINER_NETWORK": "none",
            "GPULAYER_EXECUTOR_CONTAINER_RUNTIME": "crun",
            "GPULAYER_EXECUTOR_CONTAINER_PULL_TIMEOUT_S": "20",
            "GPULAYER_EXECUTOR_CDI_DIRS": f"{tmp_path}{os.pathsep}/x",
            "GPULAYER_EXECUTOR_CDI_KIND": "example.com/gpu",
        },
        euid=4321,
    )
    assert (config.container_network, config.container_runtime) == ("none", "crun")
    assert config.container_pull_timeout_s == 20.0
    assert (config.cdi_dirs, config.cdi_kind) == ((str(tmp_path), "/x"), "example.com/gpu")
    # No podman on the node: container jobs fail saying so, the executor still starts.
    assert settings({**base, "PATH": "/nonexistent"}, euid=4321).podman is None


def test_limit_settings(tmp_path: Path) -> None:
    config = settings(
        {
            "GPULAYER_NODE_ID": "n1",
            "GPULAYER_EXECUTOR_ENFORCE": "off",
            "GPULAYER_EXECUTOR_JOB_PIDS_MAX": "0",
            "GPULAYER_EXECUTOR_DEVICE_DIR": str(tmp_path),
            "GPULAYER_EXECUTOR_RESERVED_CORES": "0.5",
            "GPULAYER_EXECUTOR_RESERVED_MEMORY_GB": "0",
            **KEYS,
        }
    )
    assert (config.enforce, config.job_pids_max, config.device_dir) == (False, 0, tmp_path)
    assert (config.reserved_cores, config.reserved_memory_gb) == (0.5, 0.0)
    on = settings({"GPULAYER_NODE_ID": "n1", "GPULAYER_EXECUTOR_ENFORCE": "ON", **KEYS})
    assert on.enforce


def test_signing_settings() -> None:
    base = {"GPULAYER_NODE_ID": "n1"}
    # Secure by default: no keys is an error naming the setting, not an executor that runs
    # whatever it is sent.
    with pytest.raises(ConfigError, match="GPULAYER_PLACEMENT_PUBLIC_KEYS is not set"):
        settings(base)
    off = settings({**base, "GPULAYER_GRANT_SIGNING": "off"})
    assert (off.require_signatures, off.placement_public_keys) == (False, ())
    two = f"{TEST_SIGNER.public_key},{TEST_SIGNER.public_key[::-1]}"
    rotating = settings({**base, "GPULAYER_PLACEMENT_PUBLIC_KEYS": two})
    assert len(rotating.placement_public_keys) == 2
    assert settings({**base, **KEYS, "GPULAYER_GRANT_MAX_AGE_S": "60"}).grant_max_age_s == 60
    # Older than the records' retention, a replay would find no record to stop it.
    with pytest.raises(ConfigError, match="below the grant record retention"):
        settings({**base, **KEYS, "GPULAYER_GRANT_MAX_AGE_S": str(8 * 24 * 3600)})


def test_overrides() -> None:
    config = settings(
        {
            "GPULAYER_NODE_ID": "n1",
            "GPULAYER_EXECUTOR_WORKDIR": "/tmp/wd",
            "GPULAYER_KILL_GRACE_S": "0.5",
            "GPULAYER_EXECUTOR_MAX_JOBS": "3",
            "GPULAYER_EXECUTOR_DRAIN_S": "30",
            **KEYS,
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
        ({"GPULAYER_EXECUTOR_ALLOW_ROOT_JOBS": "maybe"}, "expected 1 or 0"),
        ({"GPULAYER_EXECUTOR_USER_MAP": "/no/such/map.toml"}, "USER_MAP='/no/such/map.toml'"),
        ({"GPULAYER_EXECUTOR_MAX_JOBS": "0"}, "MAX_JOBS='0': expected a whole number from 1"),
        # More slots than a heartbeat may announce: placement would refuse every beat.
        ({"GPULAYER_EXECUTOR_MAX_JOBS": "70000"}, "from 1 to 65536"),
        ({"GPULAYER_KILL_GRACE_S": "soon"}, "number"),
        ({"GPULAYER_EXECUTOR_RESERVED_CORES": "-1"}, "RESERVED_CORES='-1': expected a number"),
        ({"GPULAYER_EXECUTOR_RESERVED_CORES": "nan"}, "RESERVED_CORES='nan'"),
        ({"GPULAYER_EXECUTOR_RESERVED_MEMORY_GB": "inf"}, "RESERVED_MEMORY_GB='inf'"),
        ({"GPULAYER_EXECUTOR_RESERVED_MEMORY_GB": "lots"}, "RESERVED_MEMORY_GB='lots'"),
        ({"GPULAYER_EXECUTOR_JOB_PIDS_MAX": "-5"}, "PIDS_MAX='-5': expected a whole number"),
        ({"GPULAYER_EXECUTOR_JOB_PIDS_MAX": "1e3"}, "PIDS_MAX='1e3'"),
        ({"GPULAYER_EXECUTOR_JOB_PIDS_MAX": str(2**40)}, "from 0 to 4194304"),
        ({"GPULAYER_EXECUTOR_DEVICE_DIR": "/no/such/dev"}, "DEVICE_DIR='/no/such/dev': no such"),
        ({"GPULAYER_EXECUTOR_ENFORCE": "maybe"}, "ENFORCE='maybe': expected on or off"),
        ({"GPULAYER_NODE_ID": "a.b"}, "may not contain"),
        ({"GPULAYER_EXECUTOR_CONTAINER_NETWORK": "bridge"}, "NETWORK='bridge': expected host"),
        ({"GPULAYER_EXECUTOR_CONTAINER_PULL_TIMEOUT_S": "nan"}, "PULL_TIMEOUT_S"),
        ({"GPULAYER_EXECUTOR_CONTAINER_PULL_TIMEOUT_S": "-1"}, "PULL_TIMEOUT_S"),
        ({"GPULAYER_EXECUTOR_PODMAN": "/no/such/podman"}, "PODMAN='/no/such/podman': no such"),
        ({"GPULAYER_EXECUTOR_CDI_KIND": "gpu"}, "CDI_KIND='gpu': expected vendor/class"),
    ],
)
def test_bad_settings_are_config_errors(env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        settings({"GPULAYER_NODE_ID": "n1", **KEYS, **env})


@pytest.mark.skipif(os.getuid() != 0, reason="root is refused only when it exists by that name")
def test_root_is_not_an_unprivileged_user() -> None:
    with pytest.raises(ConfigError, match="unprivileged"):
        settings({"GPULAYER_NODE_ID": "n1", "GPULAYER_EXECUTOR_USER": "root"})
    with pytest.raises(ConfigError, match="unprivileged"):
        settings({"GPULAYER_NODE_ID": "n1", "GPULAYER_EXECUTOR_JOB_USER": "root"}, euid=0)


def _nobody() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no 'nobody' account here")


def test_as_root_jobs_run_as_nobody_unless_told_otherwise(tmp_path: Path) -> None:
    nobody = _nobody()
    config = settings({"GPULAYER_NODE_ID": "n1", **KEYS}, euid=0)
    assert config.run_as is not None
    assert (config.run_as.name, config.run_as.uid) == ("nobody", nobody.pw_uid)
    allowed = settings(
        {"GPULAYER_NODE_ID": "n1", "GPULAYER_EXECUTOR_ALLOW_ROOT_JOBS": "1", **KEYS}, euid=0
    )
    assert allowed.run_as is None
    with pytest.raises(ConfigError, match="no such user"):
        settings(
            {"GPULAYER_NODE_ID": "n1", "GPULAYER_EXECUTOR_JOB_USER": "no-such-user-gl"}, euid=0
        )
    with pytest.raises(ConfigError, match="disagree"):
        settings(
            {
                "GPULAYER_NODE_ID": "n1",
                "GPULAYER_EXECUTOR_JOB_USER": "nobody",
                "GPULAYER_EXECUTOR_USER": "someone",
            },
            euid=0,
        )
    # The setting's earlier name still works.
    old = settings({"GPULAYER_NODE_ID": "n1", "GPULAYER_EXECUTOR_USER": "nobody", **KEYS}, euid=0)
    assert old.run_as == config.run_as


def test_the_user_map_is_read_from_its_file(tmp_path: Path) -> None:
    _nobody()
    path = tmp_path / "users.toml"
    path.write_text('alice = "nobody"\n')
    env = {"GPULAYER_NODE_ID": "n1", "GPULAYER_EXECUTOR_USER_MAP": str(path), **KEYS}
    config = settings(env, euid=0)
    assert config.user_map["alice"].name == "nobody"
    path.write_text('alice = "no-such-user-gl"\n')
    with pytest.raises(ConfigError, match="alice='no-such-user-gl': no such user"):
        settings(env, euid=0)
    # A non-root executor can't switch to anyone: the mapping is refused, not ignored.
    path.write_text('alice = "nobody"\n')
    with pytest.raises(ConfigError, match="only when the executor runs as root"):
        settings(env, euid=4321)


def test_credentials_a_job_user_could_read_are_refused(tmp_path: Path) -> None:
    _nobody()
    creds = tmp_path / "node.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----")
    creds.chmod(0o644)
    env = {"GPULAYER_NODE_ID": "n1", "GPULAYER_NATS_CREDS": str(creds), **KEYS}
    with pytest.raises(ConfigError, match=re.escape("readable by the job user(s) nobody")):
        settings(env, euid=0)
    creds.chmod(0o600)
    assert settings(env, euid=0).run_as is not None


def test_the_default_node_id_is_the_host_name_up_to_its_first_dot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("socket.gethostname", lambda: "gpu-01.rack7.example.com")
    assert settings({"PATH": "/bin", "HOME": "/home/x", **KEYS}).node_id == "gpu-01"
    with pytest.raises(ConfigError, match=re.escape("may not contain '.'")):
        settings({"GPULAYER_NODE_ID": "gpu-01.example", "PATH": "/bin", "HOME": "/home/x"})


def test_owners_get_their_own_uids_as_root_unless_a_job_user_is_named() -> None:
    _nobody()
    base = {"GPULAYER_NODE_ID": "n1", **KEYS}
    assert settings(base, euid=0).owner_uids == (3_000_000, 1_000_000)
    assert settings({**base, "GPULAYER_EXECUTOR_JOB_USER": "nobody"}, euid=0).owner_uids is None
    assert settings({**base, "GPULAYER_EXECUTOR_OWNER_UIDS": "off"}, euid=0).owner_uids is None
    ranged = settings({**base, "GPULAYER_EXECUTOR_OWNER_UIDS": "70000-70009"}, euid=0)
    assert ranged.owner_uids == (70000, 10)
    assert settings(base, euid=4321).owner_uids is None  # not root: no switching at all
    for bad in ("0-10", "10-5", "x", "5", f"1-{2**32}"):
        with pytest.raises(ConfigError, match="GPULAYER_EXECUTOR_OWNER_UIDS"):
            settings({**base, "GPULAYER_EXECUTOR_OWNER_UIDS": bad}, euid=0)
    with pytest.raises(ConfigError, match="only when the executor runs as root"):
        settings({**base, "GPULAYER_EXECUTOR_OWNER_UIDS": "70000-70009"}, euid=4321)


def test_a_workdir_jobs_cannot_reach_is_said_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # pytest's temporary folders are 0700, root's: nobody can't pass them.
    blocked = settings(
        {"GPULAYER_NODE_ID": "n1", "GPULAYER_EXECUTOR_WORKDIR": str(tmp_path / "w"), **KEYS},
        euid=0,
    )
    assert blocked.run_as is not None
    assert blocked.run_as.name == "nobody"
    with caplog.at_level(logging.WARNING, logger="gpulayer_executor"):
        _say_who_runs_jobs(blocked)
    # As root, each owner's jobs run as a uid of its own by default: judged as "others".
    assert blocked.owner_uids is not None
    assert "is not passable for an owner's uid" in caplog.text
    assert "jobs get no TMPDIR of their own" in caplog.text
    assert not blocked.job_tmpdir  # a TMPDIR jobs can't reach would make their tools fail
    caplog.clear()
    # Under a folder others may pass (as /var/lib): nothing said.
    top = Path(tempfile.mkdtemp(prefix="gpulayer-test-"))
    try:
        top.chmod(0o711)
        fine = settings(
            {"GPULAYER_NODE_ID": "n1", "GPULAYER_EXECUTOR_WORKDIR": str(top / "w"), **KEYS},
            euid=0,
        )
        with caplog.at_level(logging.WARNING, logger="gpulayer_executor"):
            _say_who_runs_jobs(fine)
        assert "not passable" not in caplog.text
        assert fine.job_tmpdir
    finally:
        shutil.rmtree(top, ignore_errors=True)
