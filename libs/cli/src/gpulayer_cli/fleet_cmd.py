"""The commands about the fleet: ``nodes``, ``doctor``, ``matrix`` and ``profiles``."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from rich.console import Console

from gpulayer_cli import common
from gpulayer_cli.common import EXIT_FAILED, EXIT_UNREACHABLE
from gpulayer_runtime.settings import number_option


def _render_nodes(console: Console, data: Any, devices: bool = False) -> None:
    from gpulayer_cli.render import nodes_table

    console.print(nodes_table(data))
    if devices:
        from gpulayer_cli.doctor import render_node_devices

        render_node_devices(console, data)


def cmd_doctor(args: argparse.Namespace) -> int:
    """The node's probe detects again; what changed, and the node's health. Re-detection is
    for admins (only they may publish on the doctor subject): anyone else, and ``--last``,
    gets the node's last health as placement holds it."""
    import nats.errors

    from gpulayer_cli.denials import PermissionDenied, guard
    from gpulayer_cli.doctor import ask_doctor, print_report
    from gpulayer_contracts.subjects import node_doctor

    async def go(nc: Any) -> int:
        if args.last:
            return await _last_health(nc, args.node, args.json)
        subject = node_doctor(args.node)
        try:
            report = await guard(nc, ask_doctor(nc, args.node, args.timeout), subject)
        except PermissionDenied as err:
            print(
                f"gpulayer: {err}; showing node {args.node}'s last health as placement "
                "holds it (an admin's credential re-detects)",
                file=sys.stderr,
            )
            return await _last_health(nc, args.node, args.json)
        except (TimeoutError, nats.errors.TimeoutError, nats.errors.NoRespondersError) as err:
            print(
                f"gpulayer: no probe answered for node {args.node!r} "
                f"({type(err).__name__}): is its probe running?",
                file=sys.stderr,
            )
            return EXIT_UNREACHABLE
        if report.error is not None:  # the probe refused: it is over its doctor rate limit
            print(f"gpulayer: node {args.node!r}: {report.error}", file=sys.stderr)
            return EXIT_FAILED
        return print_report(common.console(), report, args.json)

    return asyncio.run(common.with_nats(go))


async def _last_health(nc: Any, node_id: str, as_json: bool) -> int:
    """``node_id``'s last observed health from placement's API (``gpulayer nodes --devices``
    for one node); the exit status as the doctor's: 1 degraded or unhealthy, else 0."""
    from gpulayer_cli.client import api
    from gpulayer_cli.doctor import render_node_devices
    from gpulayer_contracts.subjects import API_NODES

    nodes = await api(nc, API_NODES, {}, caller=common.me())
    node = next((n for n in nodes or [] if n.get("node_id") == node_id), None)
    if node is None:
        print(f"gpulayer: placement knows no node {node_id!r} (gpulayer nodes)", file=sys.stderr)
        return EXIT_FAILED
    if as_json:
        print(json.dumps({"node_id": node_id, "health": node.get("health")}, indent=2))
    else:
        render_node_devices(common.console(), [node])
    health = (node.get("health") or {}).get("health")
    return 1 if health in ("degraded", "unhealthy") else 0


def cmd_matrix(args: argparse.Namespace) -> int:
    """The matrix is part of this version's contracts: no running service needed. ``--json``
    prints the accelerator table, ``--apis --json`` the GPU API table."""
    from gpulayer_cli.render import api_matrix_table, matrix_table
    from gpulayer_contracts.matrix import API_SUPPORT, SUPPORT_MATRIX

    if args.json:
        print(json.dumps(API_SUPPORT if args.apis else SUPPORT_MATRIX, indent=2))
        return 0
    console = common.console()
    if not args.apis:
        console.print(matrix_table(SUPPORT_MATRIX))
    console.print(api_matrix_table(API_SUPPORT))
    return 0


def _render_profiles(console: Console, data: Any) -> None:
    from gpulayer_cli.render import profiles_table

    if not data:
        console.print("no runtime profiles (placement's GPULAYER_PROFILES is unset)")
        return
    console.print(profiles_table(data))
    for entry in data:
        if entry["reasons"]:
            console.print(f"[bold]{entry['profile']}[/]: {entry['satisfy']}/{entry['nodes']}")
            for reason in entry["reasons"]:
                console.print(f"  - {reason}")


def add_nodes(sub: Any) -> None:
    from gpulayer_contracts.subjects import API_NODES

    n = sub.add_parser(
        "nodes", help="the fleet: platforms, accelerators, APIs, container runtimes, state"
    )
    n.add_argument("--json", action="store_true")
    n.add_argument(
        "--devices", action="store_true", help="each node's health and its devices' observations"
    )
    n.set_defaults(fn=common.api_command(API_NODES, lambda a: {}, _render_nodes))


def add_doctor(sub: Any) -> None:
    dr = sub.add_parser(
        "doctor",
        help="ask a node's probe to detect again now (admins; others get --last); print what "
        "changed and its health (0 healthy or undetected, 1 degraded or unhealthy, 3 no answer)",
    )
    dr.add_argument("node")
    dr.add_argument(
        "--last",
        action="store_true",
        help="the node's last observed health as placement holds it, without re-detecting",
    )
    dr.add_argument(
        "--timeout", type=number_option(), default=90.0, help="seconds to wait for the probe"
    )
    dr.add_argument("--json", action="store_true")
    dr.set_defaults(fn=cmd_doctor)


def add_matrix(sub: Any) -> None:
    m = sub.add_parser("matrix", help="what gpulayer may schedule, per accelerator and per GPU API")
    m.add_argument("--json", action="store_true", help="the accelerator table as JSON")
    m.add_argument(
        "--apis", action="store_true", help="the GPU API table alone (with --json: as JSON)"
    )
    m.set_defaults(fn=cmd_matrix)


def add_profiles(sub: Any) -> None:
    from gpulayer_contracts.subjects import API_PROFILES

    pr = sub.add_parser(
        "profiles", help="runtime profiles, and how many nodes satisfy each now (and why not)"
    )
    pr.add_argument("--json", action="store_true")
    pr.set_defaults(fn=common.api_command(API_PROFILES, lambda a: {}, _render_profiles))
