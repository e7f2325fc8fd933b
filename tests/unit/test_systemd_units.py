"""deploy/systemd/ fits the services: each unit starts its console script from the venv at
/opt/gpulayer, reads /etc/gpulayer/<service>.env, runs as the account the service needs (root
for the executor, with its cgroup delegated and its shims left running at stop; `gpulayer` for
the others), hardened where no privilege is needed; `systemd-analyze verify` accepts all four;
the example environment files set only variables the code reads."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from tests.code_facts import console_scripts, variables_read_by_code

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "deploy" / "systemd"
SERVICES = ("placement", "probe", "executor", "web")
VENV_BIN = "/opt/gpulayer/bin"

Unit = dict[str, dict[str, list[str]]]


def parse_unit(text: str) -> Unit:
    """A unit file as section -> key -> every value given, in order (systemd allows a key more
    than once: ``After=`` adds, an empty value resets). Continuation lines (``\\``) joined."""
    sections: Unit = {}
    current: dict[str, list[str]] | None = None
    pending = ""
    for raw in text.splitlines():
        line = pending + raw.strip()
        pending = ""
        if not line or line[0] in "#;":
            continue
        if line.endswith("\\"):
            pending = line[:-1].rstrip() + " "
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{line!r} before any section"
        key, sep, value = line.partition("=")
        assert sep, f"not KEY=VALUE: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def unit(service: str) -> Unit:
    return parse_unit((UNITS / f"gpulayer-{service}.service").read_text())


def one(u: Unit, section: str, key: str) -> str | None:
    """The value of a key given once (None when absent); a key repeated is a test failure."""
    values = u.get(section, {}).get(key, [])
    assert len(values) <= 1, f"[{section}] {key} given {len(values)} times: {values}"
    return values[0] if values else None


def words(u: Unit, section: str, key: str) -> list[str]:
    """A list-valued key (After=, Wants=): every value's words, an empty value resetting."""
    out: list[str] = []
    for value in u.get(section, {}).get(key, []):
        out = out + value.split() if value else []
    return out


def environment(u: Unit) -> dict[str, str]:
    """``Environment=`` assignments (unquoted ``K=V`` words, as these units write them)."""
    env: dict[str, str] = {}
    for value in u["Service"].get("Environment", []):
        for assignment in value.split():
            name, _, setting = assignment.partition("=")
            env[name] = setting
    return env


def test_parse_unit_keeps_repeated_keys_and_joins_continuations() -> None:
    u = parse_unit("[Unit]\nAfter=a\n# c\nAfter=b \\\n  c\n[Service]\nX=\n")
    assert u == {"Unit": {"After": ["a", "b c"]}, "Service": {"X": [""]}}
    assert words(parse_unit("[Unit]\nAfter=a\nAfter=\nAfter=b\n"), "Unit", "After") == ["b"]


def test_there_is_a_unit_for_each_service_and_nothing_else() -> None:
    found = {p.name for p in UNITS.glob("*.service")}
    assert found == {f"gpulayer-{s}.service" for s in SERVICES}


@pytest.mark.parametrize("service", SERVICES)
def test_each_unit_starts_its_console_script_from_the_venv(service: str) -> None:
    u = unit(service)
    script = f"gpulayer-{service}"
    assert script in console_scripts()
    # Found on PATH (verify refuses an absent absolute path; an env file may move the venv).
    assert one(u, "Service", "ExecStart") == f"/usr/bin/env {script}"
    assert VENV_BIN in environment(u)["PATH"].split(":")
    assert one(u, "Service", "Type") == "exec"


@pytest.mark.parametrize("service", SERVICES)
def test_each_unit_reads_its_own_environment_file(service: str) -> None:
    u = unit(service)
    # No "-" prefix: a missing file stops the start, rather than a service with no settings.
    assert u["Service"]["EnvironmentFile"] == [f"/etc/gpulayer/{service}.env"]
    assert (UNITS / "env" / f"{service}.env.example").is_file()


@pytest.mark.parametrize("service", SERVICES)
def test_each_unit_waits_for_the_network_restarts_and_is_enabled_at_boot(service: str) -> None:
    u = unit(service)
    assert "network-online.target" in words(u, "Unit", "After")
    assert "network-online.target" in words(u, "Unit", "Wants")
    assert one(u, "Service", "Restart") == "on-failure"
    assert one(u, "Service", "RestartSec") == "2"
    # A configuration error (exit 2) is not retried every 2 s.
    assert one(u, "Service", "RestartPreventExitStatus") == "2"
    assert words(u, "Install", "WantedBy") == ["multi-user.target"]


def test_placement_is_ordered_after_postgresql_without_needing_it() -> None:
    u = unit("placement")
    assert "postgresql.service" in words(u, "Unit", "After")
    for strong in ("Wants", "Requires", "Requisite", "BindsTo", "PartOf"):
        assert "postgresql.service" not in words(u, "Unit", strong), strong


def test_the_executor_runs_as_root_owns_its_cgroup_and_leaves_shims_running() -> None:
    u = unit("executor")
    assert one(u, "Service", "User") in (None, "root")
    assert one(u, "Service", "Group") in (None, "root")
    assert one(u, "Service", "Delegate") == "yes"
    assert one(u, "Service", "KillMode") == "process"
    assert one(u, "Service", "OOMPolicy") == "continue"
    # Jobs are its descendants: any of these would sandbox every job too.
    for key in ("PrivateTmp", "ProtectSystem", "ProtectHome", "NoNewPrivileges", "PrivateDevices"):
        assert one(u, "Service", key) is None, key


def test_the_executor_keeps_its_state_in_its_state_directory() -> None:
    u = unit("executor")
    state = one(u, "Service", "StateDirectory")
    assert state == "gpulayer-executor"
    assert "GPULAYER_EXECUTOR_WORKDIR" in variables_read_by_code()
    assert environment(u)["GPULAYER_EXECUTOR_WORKDIR"] == f"/var/lib/{state}"
    # Job accounts pass through it to their own folders.
    assert one(u, "Service", "StateDirectoryMode") == "0755"


def test_the_executor_puts_the_venv_last_on_the_path_its_jobs_inherit() -> None:
    path = environment(unit("executor"))["PATH"].split(":")
    assert path[-1] == VENV_BIN
    assert {"/usr/bin", "/bin", "/usr/sbin"} <= set(path)


@pytest.mark.parametrize("service", ["placement", "probe", "web"])
def test_the_other_services_run_as_the_gpulayer_account(service: str) -> None:
    u = unit(service)
    assert one(u, "Service", "User") == "gpulayer"
    assert one(u, "Service", "Group") == "gpulayer"
    assert one(u, "Service", "Delegate") is None


HARDENED = {
    "NoNewPrivileges": "yes",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "PrivateDevices": "yes",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "ProtectControlGroups": "yes",
    "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
    "RestrictNamespaces": "yes",
    "LockPersonality": "yes",
    "MemoryDenyWriteExecute": "yes",
    "SystemCallArchitectures": "native",
    "CapabilityBoundingSet": "",
}


@pytest.mark.parametrize("service", ["placement", "web"])
def test_placement_and_the_page_are_hardened(service: str) -> None:
    u = unit(service)
    got = {key: one(u, "Service", key) for key in HARDENED}
    assert got == HARDENED
    # They write no file: nothing is made writable for them.
    for key in ("StateDirectory", "RuntimeDirectory", "ReadWritePaths", "AmbientCapabilities"):
        assert one(u, "Service", key) is None, key


def test_the_probe_is_hardened_but_keeps_the_devices() -> None:
    u = unit("probe")
    assert one(u, "Service", "NoNewPrivileges") == "yes"
    assert one(u, "Service", "ProtectSystem") == "full"
    assert one(u, "Service", "PrivateTmp") == "yes"
    # It reads the GPU device nodes (nvidia-smi opens them).
    assert one(u, "Service", "PrivateDevices") in (None, "no")
    # Rootless podman's storage and runtime folder are the service's own.
    env = environment(u)
    assert env["HOME"] == f"/var/lib/{one(u, 'Service', 'StateDirectory')}"
    assert env["XDG_RUNTIME_DIR"] == f"/run/{one(u, 'Service', 'RuntimeDirectory')}"


@pytest.mark.parametrize("service", ["probe", "web"])
def test_services_sharing_placements_account_cannot_read_its_secrets(service: str) -> None:
    hidden = {p.lstrip("-") for p in words(unit(service), "Service", "InaccessiblePaths")}
    example = _example("placement")
    secrets = {
        example["GPULAYER_NATS_CREDS"],
        example["GPULAYER_PLACEMENT_SIGNING_KEY"],
        example["GPULAYER_DATABASE_URL"].split("passfile=", 1)[1].split("&")[0],
    }
    assert secrets <= hidden


# --- the example environment files ---------------------------------------------------------


def _example(service: str, *, commented: bool = False) -> dict[str, str]:
    """The settings an example sets (and, with ``commented``, those it shows commented out)."""
    settings: dict[str, str] = {}
    for line in (UNITS / "env" / f"{service}.env.example").read_text().splitlines():
        if commented and re.match(r"#[A-Z][A-Z0-9_]*=", line):
            line = line[1:]
        if not line.strip() or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        assert sep, f"{service}: not NAME=VALUE: {line!r}"
        assert re.fullmatch(r"[A-Z][A-Z0-9_]*", name), f"{service}: {line!r}"
        settings[name] = value
    return settings


@pytest.mark.parametrize("service", SERVICES)
def test_example_variables_are_ones_the_code_reads(service: str) -> None:
    read = variables_read_by_code()
    names = _example(service, commented=True)
    assert names
    for name in names:
        assert name.startswith("OTEL_") or name in read, f"{service}: {name} is read by nothing"


@pytest.mark.parametrize("service", SERVICES)
def test_examples_reach_nats_with_a_credential_and_its_ca(service: str) -> None:
    env = _example(service)
    assert env["GPULAYER_NATS_URL"].startswith("tls://")
    assert re.fullmatch(r"/etc/gpulayer/[a-z0-9-]+\.creds", env["GPULAYER_NATS_CREDS"])
    assert env["GPULAYER_NATS_TLS_CA"] == "/etc/gpulayer/ca.crt"


def test_examples_set_what_each_service_needs() -> None:
    assert _example("placement")["GPULAYER_DATABASE_URL"].startswith("postgresql://")
    assert _example("placement")["GPULAYER_PLACEMENT_SIGNING_KEY"].startswith("/etc/gpulayer/")
    probe, executor = _example("probe"), _example("executor")
    assert probe["GPULAYER_NODE_ID"] == executor["GPULAYER_NODE_ID"]
    # The probe and the executor of a node share its credential.
    assert probe["GPULAYER_NATS_CREDS"] == executor["GPULAYER_NATS_CREDS"]
    assert "GPULAYER_PLACEMENT_PUBLIC_KEYS" in executor
    # Set by the unit, to its state directory.
    assert "GPULAYER_EXECUTOR_WORKDIR" not in executor
    assert _example("web")["GPULAYER_NATS_CREDS"].startswith("/etc/gpulayer/viewer-")
    # Only placement holds a database URL.
    for service in ("probe", "executor", "web"):
        assert "GPULAYER_DATABASE_URL" not in _example(service, commented=True), service


# --- systemd's own check -----------------------------------------------------------------------

needs_systemd = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze is not on PATH"
)


def _verify(*paths: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["systemd-analyze", "verify", *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@needs_systemd
def test_systemd_analyze_verify_accepts_every_unit() -> None:
    done = _verify(*sorted(UNITS.glob("*.service")))
    assert (done.returncode, done.stderr) == (0, "")


@needs_systemd
def test_systemd_analyze_verify_would_refuse_a_program_that_is_absent(tmp_path: Path) -> None:
    # Why the units find their program on PATH: /opt/gpulayer/bin is not there on this machine.
    text = (UNITS / "gpulayer-web.service").read_text()
    broken = tmp_path / "gpulayer-web.service"
    broken.write_text(
        text.replace("ExecStart=/usr/bin/env gpulayer-web", "ExecStart=/nonexistent/gpulayer-web")
    )
    done = _verify(broken)
    assert done.returncode != 0
    assert "/nonexistent/gpulayer-web" in done.stderr
