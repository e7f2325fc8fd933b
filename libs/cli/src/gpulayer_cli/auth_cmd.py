"""``gpulayer auth``: make the operator and account once, then mint a credential per node,
user, admin or read-only viewer, with its role's NATS permissions. Minting needs only the auth folder's account
signing key; the server's config never changes (docs/security.md)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from gpulayer_runtime.auth import AuthError, AuthStore
from gpulayer_runtime.roles import Role

DEFAULT_AUTH_DIR = ".gpulayer/auth"


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
        role: Role = {
            "add-node": "node",
            "add-user": "user",
            "add-admin": "admin",
            "add-viewer": "viewer",
        }.get(args.auth_command, "placement")  # type: ignore[assignment]
        path = store.mint(role, getattr(args, "name", ""))
    except (AuthError, ValueError) as err:
        print(f"gpulayer auth: {err}", file=sys.stderr)
        return 2
    print(path)
    print(
        f"give it to the {role}'s processes as GPULAYER_NATS_CREDS={path} (mode 0600; "
        "whoever reads it acts as that identity)",
        file=sys.stderr,
    )
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """The ``auth`` command and its subcommands."""
    auth = sub.add_parser("auth", help="make NATS credentials (operator, nodes, users, admins)")
    auth.add_argument(
        "--dir",
        default=os.environ.get("GPULAYER_AUTH_DIR") or DEFAULT_AUTH_DIR,
        help="the auth folder (default: $GPULAYER_AUTH_DIR or .gpulayer/auth, as dev up uses)",
    )
    auth_sub = auth.add_subparsers(dest="auth_command", required=True)
    auth_sub.add_parser("init", help="make the operator, accounts and server config once")
    auth_sub.add_parser("add-placement", help="mint placement's credential")
    for command, what in (
        ("add-node", "a node (its probe and executor): NODE is its GPULAYER_NODE_ID"),
        ("add-user", "a user: submits, follows and cancels its own jobs"),
        ("add-admin", "an admin: everything; list it in placement's GPULAYER_ADMINS"),
        ("add-viewer", "a read-only viewer (the fleet page): reads, never submits or cancels"),
    ):
        p = auth_sub.add_parser(command, help=f"mint the credential of {what}")
        p.add_argument("name")
    auth.set_defaults(fn=cmd_auth)
