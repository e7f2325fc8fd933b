"""The commands of whoever runs gpulayer: ``keys`` (grant signing), ``quota`` (per-owner
limits), ``dlq`` (the dead letters) and ``node forget`` (a node that never comes back). ``auth``
has a module of its own (``auth_cmd``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from gpulayer_cli import common
from gpulayer_cli.common import EXIT_INVALID
from gpulayer_runtime.settings import number_option


def cmd_keys_generate(args: argparse.Namespace) -> int:
    from gpulayer_runtime.signing import (
        PUBLIC_KEYS_SETTING,
        SIGNING_KEY_SETTING,
        SigningKeyError,
        generate_key_pair,
    )

    try:
        seed, public = generate_key_pair(Path(args.dir), args.name)
    except (OSError, SigningKeyError) as err:
        print(f"gpulayer keys generate: {err}", file=sys.stderr)
        return EXIT_INVALID
    print("# placement (keep the seed file private: mode 0600, never on an executor's host)")
    print(f"{SIGNING_KEY_SETTING}={seed.resolve()}")
    print("# every executor (comma-separate several keys while rotating)")
    print(f"{PUBLIC_KEYS_SETTING}={public}")
    return 0


def _render_quotas(console: Console, data: Any) -> None:
    from gpulayer_cli.render import quotas_table

    console.print(quotas_table(data))


def _quota_body(args: argparse.Namespace) -> dict[str, Any]:
    """The API request of ``gpulayer quota set|delete|list``."""
    if args.quota_op == "list":
        return {"op": "list"}
    owner = None if args.default else args.owner
    if owner is None and not args.default:
        raise SystemExit("gpulayer quota: name an OWNER or give --default")
    if args.quota_op == "delete":
        return {"op": "delete", "owner": owner}
    gpus: dict[str, int] = {}
    for item in args.gpus or []:
        acc, sep, n = item.partition("=")
        if not sep or not n.lstrip("-").isdigit():
            raise SystemExit(f"gpulayer quota: --gpus {item!r} is not ACCELERATOR=N")
        gpus[acc] = int(n)
    return {"op": "set", "owner": owner, "gpus": gpus, "cores": args.cores, "jobs": args.jobs}


def cmd_dlq(args: argparse.Namespace) -> int:
    """The newest dead letters, from the DLQ stream."""
    from gpulayer_cli.dlq import dead_letters, dlq_table

    async def go(nc: Any) -> int:
        entries = await dead_letters(nc.jetstream(), args.limit)
        if args.json:
            print(json.dumps(entries, indent=2))
        else:
            common.console().print(dlq_table(entries))
        return 0

    return asyncio.run(common.with_nats(go))


def add_keys(sub: Any) -> None:
    keys = sub.add_parser("keys", help="placement's grant signing key")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    kg = keys_sub.add_parser(
        "generate", help="make a signing key pair (kept if one exists); print the settings"
    )
    kg.add_argument("dir", help="folder for the seed file")
    kg.add_argument("--name", default="placement", help="seed file name (<name>.seed)")
    kg.set_defaults(fn=cmd_keys_generate)


def add_quota(sub: Any) -> None:
    from gpulayer_contracts.subjects import API_QUOTA

    qp = sub.add_parser("quota", help="per-owner quotas: list (anyone), set and delete (admins)")
    qs = qp.add_subparsers(dest="quota_op", required=True)
    for name, text in (
        ("set", "set an owner's (or the default) quota; -1 clears a limit"),
        ("delete", "remove an owner's (or the default) quota"),
        ("list", "every quota and what each owner holds now"),
    ):
        p = qs.add_parser(name, help=text)
        if name != "list":
            p.add_argument("owner", nargs="?")
            p.add_argument("--default", action="store_true", help="the default quota")
        if name == "set":
            p.add_argument("--gpus", action="append", metavar="ACC=N", help="e.g. cuda=8")
            # -1 clears the limit.
            p.add_argument("--cores", type=number_option(low=-1, low_open=False), default=None)
            p.add_argument("--jobs", type=int, default=None)
        p.add_argument("--json", action="store_true")
        p.set_defaults(fn=common.api_command(API_QUOTA, _quota_body, _render_quotas))


def _render_forgotten(console: Console, data: Any) -> None:
    console.print(data["summary"], markup=False)


def add_node(sub: Any) -> None:
    from gpulayer_contracts.subjects import API_NODE

    np_ = sub.add_parser("node", help="admins: operate on one node")
    ns = np_.add_subparsers(dest="node_op", required=True)
    nf = ns.add_parser(
        "forget",
        help="release what a node that never comes back still holds (its fences, its jobs); "
        "refused while it heartbeats",
    )
    nf.add_argument("node_id", metavar="NAME")
    nf.add_argument("--json", action="store_true")
    nf.set_defaults(
        fn=common.api_command(
            API_NODE, lambda args: {"op": "forget", "node_id": args.node_id}, _render_forgotten
        )
    )


def add_dlq(sub: Any) -> None:
    dl = sub.add_parser("dlq", help="messages placement could not handle (the dead letters)")
    dl.add_argument("--limit", type=int, default=50, help="the newest N entries")
    dl.add_argument("--json", action="store_true")
    dl.set_defaults(fn=cmd_dlq)
