"""deploy/ fits together and fits the code.

compose.yaml: commands are console scripts, variables are read by the code (or are standard
OpenTelemetry SDK variables), every image is pinned, every mounted file and the Dockerfile exist,
start order waits on healthchecks, state lives in volumes. otel-collector.yaml: receives OTLP on
the port the services send to, traces go to Jaeger, metrics to a Prometheus endpoint that
prometheus.yml scrapes. Grafana: datasources and dashboards are provisioned, and every metric a
dashboard query names is one the code emits (gpulayer_runtime.telemetry.METRICS).
"""

from __future__ import annotations

import json
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import opentelemetry.sdk.environment_variables as otel_env
import pytest
import yaml
from tests.code_facts import console_scripts, variables_read_by_code

from gpulayer_runtime.auth import RESOLVER_DIR
from gpulayer_runtime.telemetry import METRICS, prometheus_name

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OURS = ("placement", "probe", "executor")

Doc = dict[str, Any]


def _otel_variables() -> set[str]:
    """Variables the OpenTelemetry SDK reads (its own table), plus those our code reads."""
    names = {v for k, v in vars(otel_env).items() if k.startswith("OTEL_") and isinstance(v, str)}
    for path in ROOT.glob("libs/*/src/**/*.py"):
        names |= set(re.findall(r'"(OTEL_[A-Z0-9_]+)"', path.read_text()))
    return names


def _yaml(path: Path) -> Doc:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), f"{path} is not a mapping"
    return data


def _compose() -> Doc:
    return _yaml(DEPLOY / "compose.yaml")


def _services() -> dict[str, Doc]:
    services: dict[str, Doc] = _compose()["services"]
    return services


def _env(svc: Doc) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):  # the KEY=value list form
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def _short_name(image: str) -> str:
    """``docker.io/library/nats:2.10`` as ``nats:2.10`` (compose names Docker Hub's images in
    full: podman resolves no short name where no search registry is set)."""
    for registry in ("docker.io/library/", "docker.io/"):
        if image.startswith(registry):
            return image[len(registry) :]
    return image


def _by_image(prefix: str) -> str:
    names = [
        n for n, s in _services().items() if _short_name(str(s.get("image", ""))).startswith(prefix)
    ]
    assert len(names) == 1, f"expected one service with image {prefix}*, found {names}"
    return names[0]


def _mounts(svc: Doc) -> list[tuple[str, str]]:
    """(source, target) of each volume entry, short or long syntax."""
    out: list[tuple[str, str]] = []
    for entry in svc.get("volumes", []) or []:
        if isinstance(entry, str):
            source, target = entry.split(":")[:2]
        else:
            source, target = str(entry.get("source", "")), str(entry["target"])
        out.append((source, target))
    return out


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def _collector() -> Doc:
    return _yaml(DEPLOY / "otel-collector.yaml")


# --- compose: the services ---------------------------------------------------------------------


def test_every_service_command_is_a_console_script() -> None:
    scripts = console_scripts()
    services = _services()
    ours = {
        name: s
        for name, s in services.items()
        if str(s.get("image", "")).startswith("localhost/gpulayer:")
    }
    assert {"placement", "probe", "executor"} <= set(ours)
    for name, svc in ours.items():
        assert svc["command"][0] in scripts, f"{name}: {svc['command'][0]} is not a console script"


def test_every_variable_is_one_the_code_reads() -> None:
    read = variables_read_by_code()
    for name, svc in _services().items():
        for var in svc.get("environment", {}) or {}:
            if var.startswith("GPULAYER_"):
                assert var in read, f"{name}: {var} is not read by any service"


def test_otel_variables_are_standard_ones() -> None:
    known = _otel_variables()
    for name, svc in _services().items():
        for var in _env(svc):
            if var.startswith("OTEL_"):
                assert var in known, f"{name}: {var} is not an OpenTelemetry SDK variable"


def test_services_export_to_the_collector() -> None:
    services = _services()
    collector = _by_image("otel/opentelemetry-collector-contrib")
    http = _collector()["receivers"]["otlp"]["protocols"]["http"]
    otlp_http_port = _port(http["endpoint"])
    for name in OURS:
        env = _env(services[name])
        url = urlsplit(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
        # The services' exporter is OTLP/HTTP: the endpoint is the HTTP receiver, not gRPC.
        assert url.scheme == "http", name
        assert url.hostname == collector, f"{name}: {url.hostname} is not the collector service"
        assert url.port == otlp_http_port, f"{name}: port {url.port} is not the OTLP/HTTP port"
        assert env["OTEL_SERVICE_NAME"] == f"gpulayer-{name}"
        assert env["GPULAYER_LOG_FORMAT"] == "json"


def test_third_party_images_are_named_in_full() -> None:
    """podman resolves a short name only through search registries, which Debian's podman has
    none of: every image is named with its registry."""
    for name, svc in _services().items():
        ref = str(svc["image"])
        assert ref.split("/")[0] in ("docker.io", "localhost"), f"{name}: {ref}"


def test_images_are_pinned_and_built_once() -> None:
    services = _services()
    built = [n for n, s in services.items() if s.get("build")]
    assert built == ["placement"], f"one service builds the image, found {built}"
    image = services["placement"]["image"]
    for name, svc in services.items():
        ref = str(svc["image"])
        if name in (*OURS, "web"):
            assert ref == image, f"{name} does not run the one built image"
            continue
        repo, _, tag = ref.rpartition(":")
        assert repo, f"{name}: {ref}"
        assert re.search(r"\d", tag), f"{name}: {ref} is not pinned to a version"


def test_build_paths_exist() -> None:
    for svc in _services().values():
        build = svc.get("build")
        if build:
            context = (DEPLOY / build["context"]).resolve()
            assert context == ROOT
            dockerfile = context / build["dockerfile"]
            assert dockerfile.is_file()
            for line in dockerfile.read_text().splitlines():
                parts = line.split()
                if parts and parts[0] == "COPY" and not any(p.startswith("--from") for p in parts):
                    for source in parts[1:-1]:
                        assert (context / source).exists(), f"Dockerfile COPY {source}: missing"


def _generated(svc: Doc) -> dict[str, str]:
    """target -> source of the service's mounts of generated files (secrets that are not in
    the repository): bind mounts that must exist (no empty folder made in their place)."""
    return {
        str(m["target"]): str(m["source"])
        for m in svc.get("volumes", []) or []
        if isinstance(m, dict) and m.get("bind", {}).get("create_host_path") is False
    }


def test_mounted_files_exist() -> None:
    for name, svc in _services().items():
        generated = set(_generated(svc).values())
        for source, _ in _mounts(svc):
            if source.startswith((".", "/")) and source not in generated:
                assert (DEPLOY / source).exists(), f"{name}: {source} does not exist"


def test_generated_files_are_kept_out_of_git_and_required() -> None:
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert "deploy/.env" in ignored
    assert "deploy/auth/" in ignored
    for name, svc in _services().items():
        for source in _generated(svc).values():
            assert source.startswith("./auth/"), f"{name}: generated {source} outside deploy/auth"
            mount = next(m for m in svc["volumes"] if isinstance(m, dict) and m["source"] == source)
            assert mount["read_only"] is True, f"{name}: {source} is mounted writable"


# --- compose: deployment defaults (issue 12) ------------------------------------------------------

_VAR = re.compile(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?error}: an error raises KeyError."""

    def one(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        value = env.get(name)
        if op and op.endswith("?") and not value:
            raise KeyError(f"{name}: {arg}")
        if op and op.endswith("-") and not value:
            return arg
        return value or ""

    return _VAR.sub(one, text)


def _published(svc: Doc) -> list[tuple[str, Any]]:
    """(host ip, published port) of each published port, from the short or long syntax."""
    out: list[tuple[str, Any]] = []
    for entry in svc.get("ports", []) or []:
        if isinstance(entry, dict):
            out.append((str(entry.get("host_ip", "")), entry.get("published")))
            continue
        parts = str(entry).rsplit(":", 2)
        out.append((parts[0] if len(parts) == 3 else "", parts[-2] if len(parts) > 1 else None))
    return out


def test_every_published_port_is_on_loopback_unless_told_otherwise() -> None:
    published = 0
    for name, svc in _services().items():
        for host, port in _published(svc):
            published += 1
            assert host, f"{name}: port {port} is published on every interface"
            assert interpolate(host, {}) == "127.0.0.1", f"{name}: {host}:{port}"
            assert interpolate(host, {"GPULAYER_BIND": "0.0.0.0"}) == "0.0.0.0", name
    assert published >= 8  # NATS (2), PostgreSQL, OTLP (3), Jaeger, Prometheus, Grafana


_SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|_KEY$")


def _required(value: str) -> set[str]:
    return {m.group(1) for m in _VAR.finditer(value) if m.group(2) == ":?"}


def test_no_service_has_a_default_password() -> None:
    for name, svc in _services().items():
        env = _env(svc)
        for var, value in env.items():
            if _SECRET_NAME.search(var) and not value.startswith("/run/secrets/"):
                # (A path to a mounted secret file names the secret; it isn't one.)
                m = _VAR.fullmatch(value)
                assert m, f"{name}: {var}={value!r} is a built-in secret"
                assert m.group(2) == ":?", f"{name}: {var}={value!r} is not a required secret"
            if "://" in value:
                # A password in a URL comes from a required variable too, never the file.
                given = {v: f"from-env-{v}" for v in _required(value)}
                password = urlsplit(interpolate(value, given)).password
                assert password is None or password.startswith("from-env-"), (
                    f"{name}: {var} has a built-in password"
                )
        # Nothing falls back to a default where a secret belongs.
        for value in env.values():
            for m in _VAR.finditer(value):
                assert not (_SECRET_NAME.search(m.group(1)) and m.group(2) == ":-"), (name, value)
    pg = _env(_services()["postgres"])
    assert pg.get("POSTGRES_HOST_AUTH_METHOD", "") not in ("trust", "")
    assert "trust" not in pg.get("POSTGRES_INITDB_ARGS", "")
    grafana = _env(_services()[_by_image("grafana/grafana")])
    assert grafana["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert grafana["GF_SECURITY_ADMIN_PASSWORD"] != "admin"


def test_gen_env_writes_every_required_variable_privately(tmp_path: Path) -> None:
    required: set[str] = set()
    for svc in _services().values():
        for value in [*_env(svc).values(), str(svc.get("user", ""))]:
            required |= _required(value)
    out = tmp_path / ".env"
    script = [sys.executable, str(DEPLOY / "gen-env"), "--out", str(out)]
    done = subprocess.run(script, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    first = dict(line.split("=", 1) for line in out.read_text().splitlines() if "=" in line)
    # The grant signing key pair comes from the second documented step, `gpulayer keys
    # generate deploy/keys >> deploy/.env` (it needs the installed package; gen-env doesn't).
    keys = subprocess.run(
        [sys.executable, "-m", "gpulayer_cli.main", "keys", "generate", str(tmp_path / "keys")],
        capture_output=True,
        text=True,
        check=True,
    )
    from_keys = {line.split("=", 1)[0] for line in keys.stdout.splitlines() if "=" in line}
    missing = required - set(first) - from_keys
    assert not missing, f"neither gen-env nor keys generate writes {sorted(missing)}"
    for var in ("POSTGRES_PASSWORD", "GRAFANA_ADMIN_PASSWORD"):
        assert len(first[var]) >= 24
        assert re.fullmatch(r"[A-Za-z0-9_-]+", first[var])  # safe inside a database URL
    # An existing file is kept (a stack's volumes keep the passwords they were made with).
    again = subprocess.run(script, capture_output=True, text=True, check=False)
    assert again.returncode == 1
    assert "exists" in again.stderr
    assert dict(line.split("=", 1) for line in out.read_text().splitlines() if "=" in line) == first
    forced = subprocess.run([*script, "--force"], capture_output=True, text=True, check=False)
    assert forced.returncode == 0
    new = dict(line.split("=", 1) for line in out.read_text().splitlines() if "=" in line)
    assert new["POSTGRES_PASSWORD"] != first["POSTGRES_PASSWORD"]
    assert stat.S_IMODE(out.stat().st_mode) == 0o600


def test_nats_runs_with_the_generated_auth_config() -> None:
    nats = _services()["nats"]
    config = nats["command"][nats["command"].index("-c") + 1]
    assert _generated(nats).get(config) == "./auth/server.conf"


def test_nats_keeps_its_account_jwts_on_its_volume() -> None:
    """server.conf's account resolver keeps revocations in ./accounts, relative to the
    server's working directory: every NATS server runs in its own volume."""
    assert RESOLVER_DIR == "./accounts"
    for name, svc in _services().items():
        if svc.get("image", "").startswith("nats:"):
            assert svc.get("working_dir") == "/data", name
            assert any(target == "/data" for _, target in _mounts(svc)), name


def test_each_service_connects_with_its_own_credentials() -> None:
    services = _services()
    node = _env(services["executor"])["GPULAYER_NODE_ID"]
    expected = {
        "placement": "./auth/creds/placement.creds",
        "probe": f"./auth/creds/node-{node}.creds",
        "executor": f"./auth/creds/node-{node}.creds",
        "web": "./auth/creds/viewer-web.creds",
    }
    for name, source in expected.items():
        creds = _env(services[name])["GPULAYER_NATS_CREDS"]
        assert _generated(services[name]).get(creds) == source, name


def test_the_fleet_page_reads_no_database_and_publishes_on_loopback() -> None:
    web = _services()["web"]
    env = _env(web)
    assert "GPULAYER_DATABASE_URL" not in env
    assert "postgres" not in (web.get("depends_on") or {})
    assert [interpolate(h, {}) for h, _ in _published(web)] == ["127.0.0.1"]
    # Bound to the container's interfaces, it still answers only the published names.
    assert interpolate(env["GPULAYER_WEB_ALLOWED_HOSTS"], {}) == "127.0.0.1,localhost"


def test_the_executor_runs_jobs_as_another_account() -> None:
    executor = _services()["executor"]
    assert str(executor["user"]) in ("root", "0")
    assert _env(executor)["GPULAYER_EXECUTOR_JOB_USER"] == "nobody"
    assert "no-new-privileges:true" in executor["security_opt"]


def _networks(svc: Doc) -> set[str]:
    """The networks a service joins (compose's default network when it names none)."""
    nets = svc.get("networks") or ["default"]
    return set(nets if isinstance(nets, list) else nets.keys())


def test_jobs_share_no_network_with_the_database() -> None:
    """Jobs run in the executor's container: it shares no network with PostgreSQL and holds no
    URL of it; placement alone joins the database's network and has its URL."""
    services = {n: s for n, s in _services().items() if not s.get("profiles")}
    declared = set(_compose()["networks"])
    for name, svc in _services().items():
        assert _networks(svc) <= declared, f"{name} joins a network compose doesn't declare"
    database = _networks(services["postgres"])
    with_database = {n for n, s in services.items() if _networks(s) & database} - {"postgres"}
    assert with_database == {"placement"}
    with_url = {n for n, s in _services().items() if "GPULAYER_DATABASE_URL" in _env(s)}
    assert with_url == {"placement"}
    # The executor still reaches NATS (and the collector, its telemetry).
    assert _networks(services["executor"]) & _networks(services["nats"])


def test_the_services_role_is_no_superuser() -> None:
    """The superuser is postgres, for the operator; placement connects as gpulayer, made by the
    init script with the password of its own from deploy/.env."""
    pg = _env(_services()["postgres"])
    assert pg["POSTGRES_USER"] == "postgres"
    url = _env(_services()["placement"])["GPULAYER_DATABASE_URL"]
    assert _required(url) == {"POSTGRES_SERVICES_PASSWORD"}
    given = urlsplit(interpolate(url, {"POSTGRES_SERVICES_PASSWORD": "from-env"}))
    assert (given.username, given.password) == ("gpulayer", "from-env")
    assert ("./postgres-init", "/docker-entrypoint-initdb.d") in [
        (src, dst.removesuffix(":ro")) for src, dst in _mounts(_services()["postgres"])
    ]
    script = (DEPLOY / "postgres-init" / "10-gpulayer-role.sh").read_text()
    assert "NOSUPERUSER NOCREATEDB NOCREATEROLE" in script
    assert "\\getenv password POSTGRES_SERVICES_PASSWORD" in script  # never on psql's command line


def test_start_order_waits_on_healthchecks() -> None:
    services = _services()
    for name in ("nats", "postgres"):
        assert services[name].get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    for name in OURS:
        deps = services[name]["depends_on"]
        assert deps["nats"]["condition"] == "service_healthy", name
    assert services["placement"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name, svc in services.items():
        for dep, how in (svc.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown service {dep}"
            if how["condition"] == "service_healthy":
                assert services[dep].get("healthcheck"), f"{name} waits on {dep}'s missing check"


def test_state_lives_in_named_volumes() -> None:
    compose = _compose()
    declared = set(compose.get("volumes") or {})
    services = _services()
    for name, target in (
        ("nats", "/data"),
        ("postgres", "/var/lib/postgresql/data"),
        ("executor", _env(services["executor"])["GPULAYER_EXECUTOR_WORKDIR"]),
        ("prometheus", "/prometheus"),
        ("grafana", "/var/lib/grafana"),
    ):
        named = [s for s, t in _mounts(services[name]) if t == target]
        assert named, f"{name}: nothing is mounted at {target}"
        assert named[0] in declared, f"{name}: {target} is not on a named volume"
    if "-sd" in services["nats"]["command"]:
        nats_cmd = services["nats"]["command"]
        assert nats_cmd[nats_cmd.index("-sd") + 1] == "/data"


def test_nats_runs_jetstream_with_monitoring() -> None:
    nats = _services()["nats"]
    assert "-js" in nats["command"] or "--jetstream" in nats["command"]
    assert "-m" in nats["command"] or "--http_port" in nats["command"]


# --- compose: the NATS cluster profile (issue 16) ------------------------------------------------


def _arg(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_cluster_profile_is_three_routed_jetstream_servers() -> None:
    services = _services()
    members = {n: s for n, s in services.items() if "cluster" in (s.get("profiles") or [])}
    assert len(members) == 3, sorted(members)
    declared = set(_compose().get("volumes") or {})
    single = services["nats"]
    assert not single.get("profiles"), "the single server is the default"
    cluster_ports = {}
    for name, svc in members.items():
        command = [str(c) for c in svc["command"]]
        assert svc["image"] == single["image"], name
        assert "-js" in command, name
        assert _arg(command, "--name") == name, f"{name}: a server name of its own"
        assert _arg(command, "--cluster_name") == "gpulayer", name
        listen = urlsplit(_arg(command, "--cluster"))
        cluster_ports[name] = listen.port
        # The same generated auth config as the single server (operator mode, full resolver).
        assert _generated(svc).get(_arg(command, "-c")) == "./auth/server.conf", name
        store = [src for src, target in _mounts(svc) if target == _arg(command, "-sd")]
        assert store, f"{name}: nothing mounted at its JetStream store"
        assert store[0] in declared, f"{name}: JetStream store not on a named volume"
        assert svc.get("healthcheck", {}).get("test"), f"{name}: no healthcheck"
    stores = {next(s for s, t in _mounts(svc) if t == "/data") for svc in members.values()}
    assert len(stores) == 3, "each member stores JetStream on a volume of its own"
    for name, svc in members.items():
        routes = {
            urlsplit(r) for r in _arg([str(c) for c in svc["command"]], "--routes").split(",")
        }
        # Each routes to the other two, at the port they listen on for routes.
        assert {(r.hostname, r.port) for r in routes} == {
            (other, port) for other, port in cluster_ports.items() if other != name
        }, name


def test_services_reach_the_cluster_by_setting_and_default_to_the_single_server() -> None:
    services = _services()
    members = sorted(n for n, s in services.items() if "cluster" in (s.get("profiles") or []))
    for name in OURS:
        url = _env(services[name])["GPULAYER_NATS_URL"]
        assert url == "${GPULAYER_NATS_URL:-nats://nats:4222}", name
    replicas = _env(services["placement"])["GPULAYER_STREAM_REPLICAS"]
    assert replicas == "${GPULAYER_STREAM_REPLICAS:-1}"
    # The settings compose.yaml's header gives for the cluster name its three members, and as
    # many stream copies.
    header = (DEPLOY / "compose.yaml").read_text()
    cluster_url = ",".join(f"nats://{m}:4222" for m in members)
    assert f"GPULAYER_NATS_URL={cluster_url}" in header
    assert f"GPULAYER_STREAM_REPLICAS={len(members)}" in header


# --- compose: the GPU override (issue 20) ----------------------------------------------------------


def _gpu_override() -> dict[str, Doc]:
    services: dict[str, Doc] = _yaml(DEPLOY / "compose.gpu.yaml")["services"]
    return services


def _nvidia_reservation(svc: Doc) -> Doc:
    devices = svc["deploy"]["resources"]["reservations"]["devices"]
    nvidia = [d for d in devices if d.get("driver") == "nvidia"]
    assert len(nvidia) == 1, devices
    reservation: Doc = nvidia[0]
    return reservation


def test_gpu_override_gives_the_executor_and_probe_the_hosts_gpus() -> None:
    base, gpu = _services(), _gpu_override()
    assert set(gpu) == {"executor", "probe"}
    for name, svc in gpu.items():
        # It only adds the GPU: image, command, user and settings stay those of compose.yaml.
        assert set(svc) <= {"deploy", "volumes"}, f"{name}: {sorted(svc)}"
        assert name in base
        reservation = _nvidia_reservation(svc)
        # "gpu" selects the device; "utility" brings nvidia-smi and NVML into the container,
        # "compute" the CUDA driver jobs run on (NVIDIA_DRIVER_CAPABILITIES).
        assert {"gpu", "compute", "utility"} <= set(reservation["capabilities"]), name
        assert reservation.get("count") == "all" or reservation.get("device_ids"), name
    # Both see the same GPUs: the probe reports what the executor's jobs get.
    assert _nvidia_reservation(gpu["probe"]) == _nvidia_reservation(gpu["executor"])


def test_gpu_override_shows_the_probe_the_hosts_cdi_specs() -> None:
    from gpulayer_detection.base import DEFAULT_CDI_DIRS

    probe = _gpu_override()["probe"]
    mounts = {(str(m["source"]), str(m["target"])): m for m in probe["volumes"]}
    for folder in DEFAULT_CDI_DIRS:  # where the probe looks for container GPU APIs
        mount = mounts.get((folder, folder))
        assert mount is not None, f"the probe does not see the host's {folder}"
        assert mount["read_only"] is True
    # The base file's mounts (the node's credential) are kept: compose merges by target.
    base_targets = {t for _, t in _mounts(_services()["probe"])}
    assert base_targets.isdisjoint(t for _, t in mounts)


def test_readme_says_how_to_start_the_gpu_stack() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "docker compose -f deploy/compose.yaml -f deploy/compose.gpu.yaml up" in readme
    assert "compose.gpu.yaml" in (DEPLOY / "compose.yaml").read_text()


# --- the collector and Prometheus -----------------------------------------------------------------


def test_collector_config_is_the_mounted_one() -> None:
    svc = _services()[_by_image("otel/opentelemetry-collector-contrib")]
    config = next(a.split("=", 1)[1] for a in svc["command"] if a.startswith("--config="))
    assert ("./otel-collector.yaml", config) in _mounts(svc)


def test_collector_pipelines_reach_jaeger_and_prometheus() -> None:
    cfg = _collector()
    services = _services()
    assert _port(cfg["receivers"]["otlp"]["protocols"]["http"]["endpoint"]) == 4318
    pipelines = cfg["service"]["pipelines"]
    for pipeline in pipelines.values():
        for kind in ("receivers", "processors", "exporters"):
            for component in pipeline.get(kind, []):
                assert component in cfg[kind], f"{component} is used but not configured"
        assert "otlp" in pipeline["receivers"]

    jaeger = _by_image("jaegertracing/all-in-one")
    traces = [cfg["exporters"][e] for e in pipelines["traces"]["exporters"]]
    assert any(urlsplit(f"//{e.get('endpoint', '')}").hostname == jaeger for e in traces)
    assert _env(services[jaeger]).get("COLLECTOR_OTLP_ENABLED", "true") == "true"

    prom_exporters = [
        e for e in pipelines["metrics"]["exporters"] if e.split("/")[0] == "prometheus"
    ]
    assert prom_exporters, "metrics are not exported for Prometheus"
    port = _port(cfg["exporters"][prom_exporters[0]]["endpoint"])
    collector = _by_image("otel/opentelemetry-collector-contrib")
    targets = {
        t
        for job in _yaml(DEPLOY / "prometheus.yml")["scrape_configs"]
        for static in job.get("static_configs", [])
        for t in static["targets"]
    }
    assert f"{collector}:{port}" in targets, "prometheus.yml does not scrape the collector"
    prom = _services()[_by_image("prom/prometheus")]
    assert ("./prometheus.yml", "/etc/prometheus/prometheus.yml") in _mounts(prom)


# --- Grafana -------------------------------------------------------------------------------------


def _grafana_mount(target: str) -> Path:
    svc = _services()[_by_image("grafana/grafana")]
    source = next(s for s, t in _mounts(svc) if t == target)
    return (DEPLOY / source).resolve()


def _datasources() -> list[Doc]:
    folder = _grafana_mount("/etc/grafana/provisioning") / "datasources"
    out: list[Doc] = []
    for path in sorted(folder.glob("*.y*ml")):
        out += _yaml(path)["datasources"]
    return out


def _dashboards() -> list[tuple[Path, Doc]]:
    providers_dir = _grafana_mount("/etc/grafana/provisioning") / "dashboards"
    svc = _services()[_by_image("grafana/grafana")]
    found: list[tuple[Path, Doc]] = []
    for path in sorted(providers_dir.glob("*.y*ml")):
        for provider in _yaml(path)["providers"]:
            in_container = provider["options"]["path"]
            source = next(s for s, t in _mounts(svc) if t == in_container)
            for board in sorted((DEPLOY / source).glob("*.json")):
                found.append((board, json.loads(board.read_text())))
    assert found, "no dashboard is provisioned"
    return found


def _panels(board: Doc) -> list[Doc]:
    out: list[Doc] = []
    for panel in board.get("panels", []):
        out.append(panel)
        out += _panels(panel)  # panels inside collapsed rows
    return out


def test_datasources_point_at_the_stack() -> None:
    sources = {d["type"]: d for d in _datasources()}
    assert {"prometheus", "jaeger"} <= set(sources)
    prom, jaeger = urlsplit(sources["prometheus"]["url"]), urlsplit(sources["jaeger"]["url"])
    assert prom.hostname == _by_image("prom/prometheus")
    assert prom.port == 9090
    assert jaeger.hostname == _by_image("jaegertracing/all-in-one")
    assert jaeger.port == 16686


def test_dashboards_use_provisioned_datasources() -> None:
    uids = {d["uid"] for d in _datasources()}
    for path, board in _dashboards():
        for panel in _panels(board):
            for item in [panel, *panel.get("targets", [])]:
                ds = item.get("datasource")
                if isinstance(ds, dict):
                    assert ds.get("uid") in uids, f"{path.name}: {panel['title']}: {ds}"


# PromQL words that are not metric names.
_PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
    "unless", "offset", "inf", "nan",
}  # fmt: skip


def promql_metrics(expr: str) -> set[str]:
    """Metric names in a PromQL expression (functions, labels, grouping and ranges removed)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', " ", expr)  # strings
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for m in re.finditer(r"(?<![\w$.])([A-Za-z_:][A-Za-z0-9_:]*)\b(\s*\()?", text):
        word, is_call = m.group(1), m.group(2)
        if is_call or word.lower() in _PROMQL_WORDS:
            continue
        names.add(word)
    return names


def _emitted() -> set[str]:
    names: set[str] = set()
    for name, (kind, _, _) in METRICS.items():
        base = prometheus_name(name)
        names |= (
            {f"{base}_bucket", f"{base}_sum", f"{base}_count"} if kind == "histogram" else {base}
        )
    return names


def test_promql_metric_extraction() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, source) (rate(a_seconds_bucket{x="y"}[5m])))'
        " / on (job) group_left (b) max without (c) (b_total offset 5m) > bool 0"
    )
    assert promql_metrics(expr) == {"a_seconds_bucket", "b_total"}


def test_every_dashboard_query_names_an_emitted_metric() -> None:
    emitted = _emitted()
    used: set[str] = set()
    for path, board in _dashboards():
        for panel in _panels(board):
            for target in panel.get("targets", []):
                names = promql_metrics(target["expr"])
                assert names, f"{path.name}: {panel['title']}: no metric in {target['expr']}"
                unknown = names - emitted
                assert not unknown, f"{path.name}: {panel['title']}: {sorted(unknown)} not emitted"
                used |= names
    # The dashboard covers what the issue asks for.
    for metric in (
        "gpulayer.placement.placed",
        "gpulayer.placement.decision.duration",
        "gpulayer.jobs.pending",
        "gpulayer.nodes",
        "gpulayer.devices",
        "gpulayer.node.info",
        "gpulayer.executor.jobs",
        "gpulayer.probe.detection.duration",
        "gpulayer.device.health",
        "gpulayer.device.temperature",
    ):
        assert any(u.startswith(prometheus_name(metric)) for u in used), f"{metric} not on a panel"


def _info_labels() -> set[str]:
    """The labels placement puts on gpulayer.node.info, read from the code."""
    from datetime import UTC, datetime

    from gpulayer_contracts import WorkerCapabilities
    from gpulayer_placement.fleet import Fleet
    from gpulayer_placement.metrics import node_info

    fleet = Fleet()
    fleet.upsert(WorkerCapabilities(node_id="n", agent_version="0", detected_at=datetime.now(UTC)))
    ((_, labels),) = node_info(fleet)
    return set(labels)


def test_dashboard_has_the_fleet_table() -> None:
    metric = prometheus_name("gpulayer.node.info")
    tables = [
        (panel, target)
        for _, board in _dashboards()
        for panel in _panels(board)
        if panel["type"] == "table"
        for target in panel.get("targets", [])
        if metric in promql_metrics(target["expr"])
    ]
    assert len(tables) == 1, f"one table panel reads {metric}"
    panel, target = tables[0]
    assert target["instant"] is True
    assert target["format"] == "table"
    grouped = re.search(r"\bby \(([^)]*)\)", target["expr"])
    assert grouped, target["expr"]
    columns = {label.strip() for label in grouped.group(1).split(",")}
    # A column for every label the code sets (node, hostname, platform, GPU APIs, state...).
    assert columns == _info_labels()
    hidden = panel["transformations"][0]["options"]["excludeByName"]
    assert hidden == {"Time": True, "Value": True}  # the value is always 1
    # The query keeps series measured in the last minute, which needs the samples' own times.
    assert "timestamp(" in target["expr"]
    assert _collector()["exporters"]["prometheus"]["send_timestamps"] is True


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("gpulayer.placement.decision.duration", "gpulayer_placement_decision_duration_seconds"),
        ("gpulayer.placement.placed", "gpulayer_placement_placed_total"),
        ("gpulayer.jobs.pending", "gpulayer_jobs_pending"),
    ],
)
def test_prometheus_names(name: str, expected: str) -> None:
    assert prometheus_name(name) == expected


# --- the Makefile and CI ---------------------------------------------------------------------------


def test_makefile_and_ci_call_the_readme_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "make run" in readme
    assert "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    makefile = (ROOT / "Makefile").read_text()
    for target in ("run:", "test:", "lint:", "bench:", "docs:"):
        assert f"\n{target}" in makefile


def test_make_image_without_podman_or_docker_says_what_to_install(tmp_path: Path) -> None:
    """deploy/image/build on a machine with neither engine: one line naming what to install,
    before anything is built (PATH holds only what the script needs to get that far)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname",):
        (bin_dir / tool).symlink_to(shutil.which(tool) or f"/usr/bin/{tool}")
    run = subprocess.run(
        ["/bin/bash", str(ROOT / "deploy/image/build")],
        env={"PATH": str(bin_dir)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 1, run
    assert "neither podman nor a running docker engine found" in run.stderr
    assert "apt-get install podman runc" in run.stderr
    assert run.stdout == ""


def test_the_image_is_built_on_a_chosen_base_with_the_ca_as_a_secret() -> None:
    """The Dockerfile's base is a build argument and the CA bundle reaches only the RUN steps
    that download, as a secret mount (no COPY of it, no layer keeps it)."""
    text = (ROOT / "deploy/Dockerfile").read_text()
    assert "ARG BASE=python:3.11-slim" in text
    assert text.count("FROM ${BASE}") == 2
    assert text.count("--mount=type=secret,id=ca") == 2
    assert "uv sync --locked --no-dev" in text


def test_the_tls_override_puts_every_service_on_tls_with_the_ca() -> None:
    """compose.tls.yaml: NATS serves TLS with the generated certificate; every service of ours
    connects with tls:// and checks it against the mounted CA."""
    tls = _yaml(DEPLOY / "compose.tls.yaml")["services"]
    command = tls["nats"]["command"]
    assert command[: len(_services()["nats"]["command"])] == _services()["nats"]["command"]
    assert command[command.index("--tlscert") + 1] == "/etc/nats/tls/server.pem"
    mounted = {v["target"]: v["source"] for v in tls["nats"]["volumes"]}
    assert mounted["/etc/nats/tls/server.key"] == "./tls/server.key"
    for name in (*OURS, "web"):
        env = tls[name]["environment"]
        assert env["GPULAYER_NATS_URL"].startswith("${GPULAYER_NATS_URL:-tls://nats:4222}"), name
        (ca,) = tls[name]["volumes"]
        assert ca["source"] == "./tls/ca.pem", name
        assert ca["target"] == env["GPULAYER_NATS_TLS_CA"], name
        assert ca["read_only"] is True, name


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
def test_gen_tls_makes_a_ca_and_a_server_certificate_for_the_names_given(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "GPULAYER_TLS_DIR": str(tmp_path)}
    subprocess.run([DEPLOY / "gen-tls", "ctl.example", "10.1.2.3"], env=env, check=True)
    first_ca = (tmp_path / "ca.pem").read_bytes()
    verify = subprocess.run(
        ["openssl", "verify", "-CAfile", tmp_path / "ca.pem", tmp_path / "server.pem"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert verify.returncode == 0, verify.stderr
    text = subprocess.run(
        ["openssl", "x509", "-in", tmp_path / "server.pem", "-noout", "-ext", "subjectAltName"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for name in ("DNS:nats", "DNS:localhost", "IP Address:127.0.0.1", "DNS:ctl.example"):
        assert name in text
    assert "IP Address:10.1.2.3" in text
    for key in ("ca.key", "server.key"):
        assert stat.S_IMODE((tmp_path / key).stat().st_mode) == 0o600, key
    # Run again for another name: the CA is kept (nodes already trust it).
    subprocess.run([DEPLOY / "gen-tls", "other.example"], env=env, check=True)
    assert (tmp_path / "ca.pem").read_bytes() == first_ca


def _fleet_section() -> str:
    text = (ROOT / "docs" / "operations.md").read_text()
    start = text.index("## Install on a fleet")
    return text[start : text.index("\n## ", start + 1)]


def test_the_fleet_pages_commands_are_the_ones_that_exist() -> None:
    """docs/operations.md, "Install on a fleet": each make target it names exists, and each
    install-node option it shows is one install-node takes and the deployment test passes."""
    section = _fleet_section()
    makefile = (ROOT / "Makefile").read_text()
    for target in set(re.findall(r"make ([a-z][a-z-]+)", section)):
        assert re.search(rf"^{target}:", makefile, re.MULTILINE), f"make {target}"
    block = section[section.index("deploy/install-node --nats-url") :]
    block = block[: block.index("```")]
    shown = set(re.findall(r"(--[a-z][a-z-]+)", block))
    help_text = subprocess.run(
        [ROOT / "deploy" / "install-node", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for option in shown:
        assert option in help_text, option
    test_source = (ROOT / "tests" / "deploy" / "nodes.py").read_text()
    for option in ("--nats-url", "--creds", "--ca", "--placement-keys"):
        assert option in shown, option
        assert f'"{option}"' in test_source, f"the deployment test doesn't pass {option}"


@pytest.mark.parametrize("name", ["a,b", "x y", "ctl;rm -rf /", "", "-", "a" * 300])
def test_gen_tls_refuses_a_name_that_is_no_host_or_address(tmp_path: Path, name: str) -> None:
    """A name that would break the certificate's subjectAltName (a comma, a space, ...) is
    named, exit 2, and nothing is written: not even the CA."""
    env = {"PATH": "/usr/bin:/bin", "GPULAYER_TLS_DIR": str(tmp_path / "tls")}
    run = subprocess.run(
        [DEPLOY / "gen-tls", "ok.example", name], env=env, capture_output=True, text=True
    )
    assert run.returncode == 2, run
    assert "is neither a host name nor an IP address" in run.stderr
    assert not (tmp_path / "tls").exists()
