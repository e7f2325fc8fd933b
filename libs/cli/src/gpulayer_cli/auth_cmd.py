"""``gpulayer auth``: make the operator and account once, then mint a credential per node,
user, admin or read-only viewer, with its role's NATS permissions (optionally expiring);
revoke one on the running servers without restarting them; list who holds what. Minting
needs the auth folder's account signing key, revoking its operator key (docs/security.md,
"Revocation and expiry").

``mint_identity`` and ``revoke_identity`` are what the commands do, returning what was minted
or revoked: the place to record them (an audit trail) without parsing output."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import msgspec
from rich.table import Table

from gpulayer_cli.audit_cmd import record_credential_change
from gpulayer_cli.common import EXIT_DENIED, EXIT_FAILED, EXIT_INVALID, EXIT_UNREACHABLE, console
from gpulayer_runtime.account_push import Pushed, push_account
from gpulayer_runtime.auth import MAX_EXPIRES_S, AuthError, AuthStore, KeyUnavailable
from gpulayer_runtime.credentials import Credential
from gpulayer_runtime.roles import Role

DEFAULT_AUTH_DIR = ".gpulayer/auth"
_ADD: dict[str, Role] = {
    "add-placement": "placement",
    "add-node": "node",
    "add-user": "user",
    "add-admin": "admin",
    "add-viewer": "viewer",
}
_REVOCABLE: tuple[Role, ...] = ("user", "node", "admin", "viewer")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"(\d{1,10})([smhdw])")


def parse_duration(text: str) -> int:
    """Seconds of a duration such as ``90m``, ``12h``, ``30d`` (also ``s`` and ``w``)."""
    m = _DURATION.fullmatch(text.strip())
    if m is None:
        raise ValueError(
            f"--expires {text!r}: give a whole number and a unit, such as 90m, 12h, 30d or 2w"
        )
    seconds = int(m.group(1)) * _UNITS[m.group(2)]
    if not 0 < seconds <= MAX_EXPIRES_S:
        raise ValueError(f"--expires {text!r}: give more than 0s and at most 3650d (10 years)")
    return seconds


class RevokeResult(msgspec.Struct, frozen=True, kw_only=True):
    """What ``revoke_identity`` did: the credentials revoked in the auth folder, and how the
    running servers took it (``pushed`` None: none reachable, ``push_error`` says why)."""

    role: str
    name: str
    revoked: list[Credential]
    pushed: Pushed | None = None
    push_error: str | None = None


def mint_identity(store: AuthStore, role: Role, name: str, expires_s: int | None) -> Credential:
    """Mint the credential of ``role`` ``name``; what was minted (its path:
    ``store.creds_path``)."""
    store.mint(role, name, expires_s=expires_s)
    name = "placement" if role == "placement" else name
    return next(c for c in reversed(store.credentials()) if c.role == role and c.name == name)


async def push(store: AuthStore, account_jwt: str) -> tuple[Pushed | None, str | None]:
    """Give the account JWT to the servers at ``GPULAYER_NATS_URL`` (its TLS settings too),
    as the system account: what they answered, or why none could be asked."""
    import nats.errors

    from gpulayer_runtime.settings import ConfigError, nats_settings

    creds = store.system_creds()
    try:
        settings = nats_settings(os.environ)
        pushed = await push_account(
            settings.url,
            creds,
            account_jwt,
            tls_ca=settings.tls_ca,
            tls_cert=settings.tls_cert,
            tls_key=settings.tls_key,
        )
        return pushed, None
    except ConfigError as err:
        return None, str(err)
    except (nats.errors.Error, OSError, TimeoutError) as err:
        text = str(err) or "no server answered in time"
        if "no servers available" in text:
            text = "no server answered"
        elif "authorization violation" in text.lower():
            text = "refused this folder's system account: its servers run another auth folder"
        return None, f"NATS at {os.environ.get('GPULAYER_NATS_URL') or 'the default URL'}: {text}"


async def revoke_identity(store: AuthStore, role: Role, name: str) -> RevokeResult:
    """Revoke ``role`` ``name`` in the auth folder, then on the running servers."""
    done = store.revoke(role, name)
    pushed, why = await push(store, done.account_jwt)
    return RevokeResult(
        role=role, name=name, revoked=done.credentials, pushed=pushed, push_error=why
    )


def _when(ts: int | None) -> str:
    if ts is None:
        return "never"
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%MZ")


def credentials_table(credentials: list[Credential], now: float) -> Table:
    """``gpulayer auth list``: every credential minted in the folder and what it is now."""
    t = Table(title="credentials")
    for column in ("role", "name", "public key", "issued", "expires", "state"):
        t.add_column(column)
    current: dict[tuple[str, str], str] = {}
    for c in credentials:
        current[(c.role, c.name)] = c.public_key
    for c in sorted(credentials, key=lambda c: (c.role, c.name, c.issued)):
        state = c.state(now)
        if state == "revoked":
            state = f"[red]revoked {_when(c.revoked)}[/]"
        elif state == "expired":
            state = "[yellow]expired[/]"
        elif current[(c.role, c.name)] != c.public_key:
            # Re-minted since: this older key still connects until revoked or expired.
            state = "[yellow]valid (replaced: revoke to end it)[/]"
        else:
            state = "[green]valid[/]"
        t.add_row(c.role, c.name, c.public_key, _when(c.issued), _when(c.expires), state)
    return t


def _report_push(pushed: Pushed | None, why: str | None, store: AuthStore) -> int:
    if pushed is None:
        print(
            f"gpulayer auth: no running server took it ({why}): servers started "
            f"from now on read it from {store.server_conf}; run `gpulayer auth push` (with "
            "GPULAYER_NATS_URL) when they are up",
            file=sys.stderr,
        )
        return EXIT_UNREACHABLE
    for a in pushed.answers:
        print(f"  server {a.server}: {a.message}")
    if not pushed.complete:
        silent = pushed.servers - len(pushed.answers)
        print(
            f"gpulayer auth: {sum(a.ok for a in pushed.answers)} of {pushed.servers} servers "
            "applied it"
            + (
                f"; {silent} did not answer (down or cut off: one gets it from the others "
                "within two minutes, or from server.conf when it starts)"
                if silent > 0
                else ""
            )
            + (
                "; a server that answered otherwise runs a server.conf from before revocations "
                "(memory resolver): restart it with the new one"
                if any(not a.ok for a in pushed.answers)
                else ""
            )
            + "; `gpulayer auth push` tries again",
            file=sys.stderr,
        )
        return EXIT_FAILED
    print(f"all {pushed.servers} running servers applied it")
    return 0


def _report_revoke(result: RevokeResult, store: AuthStore) -> int:
    keys = ", ".join(c.public_key[:12] + "…" for c in result.revoked)
    print(f"revoked {result.role} {result.name} in {store.folder} ({keys})")
    code = _report_push(result.pushed, result.push_error, store)
    if code == 0:
        print("its connections were closed; new ones are refused")
    return code


def cmd_auth(args: argparse.Namespace) -> int:
    store = AuthStore(Path(args.dir))
    try:
        if args.auth_command == "init":
            store.init()
            print(f"auth folder {store.folder}")
            print(f"nats-server config to include: {store.server_conf}")
            return 0
        if not store.exists():
            raise AuthError(f"{store.folder} has no account yet: run `gpulayer auth init` first")
        if args.auth_command == "list":
            console().print(credentials_table(store.credentials(), time.time()))
            return 0
        if args.auth_command == "revoke":
            result = asyncio.run(revoke_identity(store, args.role, args.name))
            code = _report_revoke(result, store)
            outcome = "ok" if code == 0 else "partial" if code == 1 else "not pushed"
            keys = ", ".join(c.public_key for c in result.revoked)
            record_credential_change("revoke", f"{args.role} {args.name}", outcome, keys)
            return code
        if args.auth_command == "push":
            return _report_push(*asyncio.run(push(store, store.account_jwt())), store)
        role = _ADD[args.auth_command]
        expires = None if args.expires is None else parse_duration(args.expires)
        minted = mint_identity(store, role, getattr(args, "name", ""), expires)
    except KeyUnavailable as err:
        print(f"gpulayer auth: {err}", file=sys.stderr)
        return EXIT_DENIED
    except (AuthError, ValueError) as err:
        print(f"gpulayer auth: {err}", file=sys.stderr)
        return EXIT_INVALID
    path = store.creds_path(role, minted.name)
    print(path)
    expiry = f"expires {_when(minted.expires)}" if minted.expires else "no expiry"
    record_credential_change("mint", f"{role} {minted.name}", "ok", expiry)
    until = f", valid until {_when(minted.expires)}" if minted.expires else ""
    print(
        f"give it to the {role}'s processes as GPULAYER_NATS_CREDS={path} (mode 0600; "
        f"whoever reads it acts as that identity{until})",
        file=sys.stderr,
    )
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """The ``auth`` command and its subcommands."""
    auth = sub.add_parser(
        "auth",
        help="NATS credentials: make, revoke and list them (operator, nodes, users, admins)",
        description="Make the operator and account once (init), mint a credential per identity "
        "(add-*, optionally expiring), revoke one on the running servers without a restart "
        "(revoke), list them (list). Run where the auth folder is: minting needs its signing "
        "key, revoking its operator key (docs/security.md).",
    )
    auth.add_argument(
        "--dir",
        default=os.environ.get("GPULAYER_AUTH_DIR") or DEFAULT_AUTH_DIR,
        help="the auth folder (default: $GPULAYER_AUTH_DIR or .gpulayer/auth, as dev up uses)",
    )
    auth_sub = auth.add_subparsers(dest="auth_command", required=True)
    auth_sub.add_parser("init", help="make the operator, accounts and server config once")
    expires_help = (
        "the credential stops working after DURATION (90m, 12h, 30d, 2w; at most 3650d); "
        "default: until revoked"
    )
    p = auth_sub.add_parser("add-placement", help="mint placement's credential")
    p.add_argument("--expires", metavar="DURATION", help=expires_help)
    for command, what in (
        ("add-node", "a node (its probe and executor): NODE is its GPULAYER_NODE_ID"),
        ("add-user", "a user: submits, follows and cancels its own jobs"),
        ("add-admin", "an admin: everything; list it in placement's GPULAYER_ADMINS"),
        ("add-viewer", "a read-only viewer (the fleet page): reads, never submits or cancels"),
    ):
        p = auth_sub.add_parser(command, help=f"mint the credential of {what}")
        p.add_argument("name")
        p.add_argument("--expires", metavar="DURATION", help=expires_help)
    revoke = auth_sub.add_parser(
        "revoke",
        help="revoke an identity's credentials, on the running servers too (no restart)",
        description="Revoke every credential minted for ROLE NAME: the account's revocation "
        "list is signed again, written to server.conf, and sent to the running servers at "
        "GPULAYER_NATS_URL, which close that identity's connections and refuse new ones. "
        "Mint a new credential for it with add-ROLE. Exit status 3: no server reachable "
        "(revoked on disk: servers started later have it; `auth push` sends it later); 1: "
        "not every server applied it; 4: no operator key here (only an admin may revoke).",
    )
    revoke.add_argument("role", choices=_REVOCABLE)
    revoke.add_argument("name", metavar="NAME")
    auth_sub.add_parser(
        "push",
        help="send the account (its revocations) to the running servers again",
    )
    auth_sub.add_parser(
        "list", help="every credential minted here: role, name, key, issued, expires, revoked"
    )
    auth.set_defaults(fn=cmd_auth)
