"""What a job can reach on its node, tried by a job on a `gpulayer dev up` stack: the database
(over TCP and through its socket, as the superuser and as the services' role, with no password
and with guessed ones), the stack's secrets on disk, NATS without a credential, the fleet page,
descriptors it could inherit, podman's socket and its own environment. docs/security.md, "What a
job can reach on its node", says the same, a row each."""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
from collections.abc import Mapping
from pathlib import Path

import asyncpg
import pytest
from tests.helpers import DevUp, dev_up

from gpulayer_runtime.database import read_pgpass_password, replace_url
from gpulayer_runtime.pgserver import postgres_bin_dir

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="jobs run as accounts of their own only as root"),
]

# The job: bash (its /dev/tcp) and the wheel's psql, which any account may run. Each line it
# prints is "what|outcome".
PROBE = r"""
psql=$1 port=$2 socket=$3 web=$4 nats=$5 workdir=$6; shift 6
echo "uid|$(id -u)"
# What ls inherits from the job's shell, and the folder it reads them from.
ls -l /proc/self/fd | sed -n 's/.* \([0-9]*\) -> \(.*\)$/fd \1|\2/p'
echo "env|$(env | cut -d= -f1 | grep -E '^(OTEL_|PG|GPULAYER_(DATABASE|NATS))' | sort | tr '\n' ' ')"
try() {
    what=$1; shift
    out=$("$psql" -w -X -A -t -c "select 'CONNECTED ' || current_user" "$@" 2>&1 </dev/null)
    echo "$what|$(printf %s "$out" | tr '\n' ' ')"
}
for user in postgres gpulayer; do
    for guess in "" postgres gpulayer password; do
        for host in 127.0.0.1 "$socket"; do
            PGPASSWORD=$guess try "psql $user@$host:${guess:-none}" -h "$host" -p "$port" \
                -U "$user" -d gpulayer
        done
    done
done
for path in "$@" "$workdir" "$socket"; do
    if [ -d "$path" ]; then ls "$path" >/dev/null 2>&1 && r=listed || r=refused
    else cat "$path" >/dev/null 2>&1 && r=read || r=refused; fi
    echo "file $path|$r"
done
for s in /run/podman/podman.sock "/run/user/$(id -u)/podman/podman.sock"; do
    if [ ! -e "$s" ]; then r=absent; elif [ -w "$s" ]; then r=writable; else r=refused; fi
    echo "podman $s|$r"
done
exec 3<>"/dev/tcp/127.0.0.1/$nats"
printf 'CONNECT {"verbose":false,"pedantic":false}\r\nPING\r\n' >&3
echo "nats|$(timeout 5 cat <&3 | tr -d '\r' | grep -- "^-ERR" | head -n 1)"
exec 3<&-
exec 4<>"/dev/tcp/127.0.0.1/$web"
printf 'GET /jobs HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&4
page=$(timeout 10 cat <&4)
echo "web|$(printf %s "$page" | head -n 1 | tr -d '\r')"
printf '%s\n' "$page" | grep -o 'secret-holder-[a-z0-9]*' | sort -u | sed 's/^/web job|/'
"""


def _probe_lines(text: str) -> dict[str, str]:
    lines = (line.split("|", 1) for line in text.splitlines() if "|" in line)
    found: dict[str, str] = {}
    for what, outcome in lines:
        found[what] = found.get(what, "") + outcome.strip()
    return found


async def _gpulayer(stack: DevUp, *args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        stack.cli, *args, env=stack.cli_env, cwd=stack.cwd,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


async def _run_job(stack: DevUp, folder: Path, job: Mapping[str, object]) -> str:
    """The job submitted as the dev user, waited for; its output."""
    path = folder / f"{job['job_id']}.json"
    path.write_text(json.dumps(job))
    code, said = await _gpulayer(stack, "submit", str(path), "--wait", "--json")
    assert code == 0, said
    code, out = await _gpulayer(stack, "logs", str(job["job_id"]))
    assert code == 0, out
    return out


async def test_a_job_reaches_nothing_of_the_stack(tmp_path: Path) -> None:
    secret = f"hf_{secrets.token_hex(12)}"
    tag = secrets.token_hex(4)
    async with dev_up(tmp_path) as stack:
        data = stack.data_dir
        port = int(re.search(r":(\d+)/", stack.database_url)[1])  # type: ignore[index]
        # The socket's folder, as the server says it (in the data folder, or a shorter path).
        socket_dir = (data / "postgres" / "pgdata" / "postmaster.pid").read_text().splitlines()[4]
        holder = {
            "job_id": f"secret-holder-{tag}",
            "command": ["true"],
            "env": {"HF_TOKEN": secret},
        }
        await _run_job(stack, tmp_path, holder)
        files = [
            data / "postgres" / "superuser.pgpass",
            data / "postgres" / "gpulayer.pgpass",
            data / "postgres" / "postgres.log",
            data / "postgres" / "pgdata" / "PG_VERSION",
            data / "auth" / "creds" / "placement.creds",
            data / "auth" / "creds" / "user-dev.creds",
            data / "keys" / "placement.seed",
            data / "executor" / "state.db",
        ]
        probe = {
            "job_id": f"prober-{tag}",
            "command": [
                "bash", "-c", PROBE, "probe", str(postgres_bin_dir() / "psql"), str(port),
                socket_dir, str(stack.web_port), str(stack.nats_port), str(data / "executor"),
                *map(str, files),
            ],
        }  # fmt: skip
        out = await _run_job(stack, tmp_path, probe)
        passwords = [
            read_pgpass_password(data / "postgres" / name, user)
            for name, user in (("superuser.pgpass", "postgres"), ("gpulayer.pgpass", "gpulayer"))
        ]
        command_lines = _command_lines()
        # What nats-server listens on, by its own word (removed when it stops).
        (ports_file,) = (data / "nats" / "ports").glob("*.ports")
        nats_ports = json.loads(ports_file.read_text())
        # The secret is in the database: there to be read by whoever gets in.
        admin_url = replace_url(
            stack.database_url, user="postgres", passfile=data / "postgres" / "superuser.pgpass"
        )
        admin = await asyncpg.connect(admin_url)
        try:
            stored = await admin.fetchval(
                "SELECT request::text FROM jobs WHERE job_id = $1", holder["job_id"]
            )
        finally:
            await admin.close()
    assert secret in stored
    said = _probe_lines(out)
    assert said["uid"] not in ("", "0"), out  # the job ran as an account of its own
    # No descriptor of the executor or its shim: 0, 1, 2 and ls's own look at them.
    fds = {int(k.split()[1]): v for k, v in said.items() if k.startswith("fd ")}
    assert {0, 1, 2} <= set(fds), out
    assert all(re.fullmatch(r"/proc/\d+/fd", v) for fd, v in fds.items() if fd > 2), out
    assert said["env"] == "", out  # no database URL, passfile, credential or OTLP setting
    tried = {k: v for k, v in said.items() if k.startswith("psql ")}
    assert len(tried) == 16, out
    for what, outcome in tried.items():
        assert "CONNECTED" not in outcome, (what, outcome)
        if "@127.0.0.1:" in what:
            assert re.search(r"password authentication failed|no password supplied", outcome), (
                what,
                outcome,
            )
        else:  # the socket's folder is the server account's alone
            assert "Permission denied" in outcome, (what, outcome)
    for path in [*files, data / "executor", Path(socket_dir)]:
        assert said[f"file {path}"] == "refused", out
    for key, outcome in said.items():
        if key.startswith("podman "):
            assert outcome in ("absent", "refused"), (key, outcome)
    assert said["nats"] == "-ERR 'Authorization Violation'", out
    # The fleet page answers anyone on the node: every job, never an env value.
    assert said["web"] == "HTTP/1.1 200 OK", out
    assert said["web job"] == holder["job_id"], out
    assert secret not in out
    # The passwords are on no command line (ps shows those to every account).
    assert len(set(passwords)) == 2
    for password in passwords:
        assert password
        assert not any(password.encode() in line for line in command_lines)
    # NATS's monitoring port (no credential) isn't opened by the stack.
    assert "monitoring" not in nats_ports, nats_ports


def _command_lines() -> list[bytes]:
    """Every process's command line, as ``ps`` shows them to any account."""
    found = []
    for path in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            found.append(path.read_bytes())
        except OSError:  # a process that ended meanwhile
            continue
    return found
