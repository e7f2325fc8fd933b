"""The commands that need no running gpulayer: ``dev up`` (which starts one), ``schema``,
``check`` and ``conform``."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from gpulayer_cli import common
from gpulayer_contracts import WIRE_SCHEMAS, wire_schema
from gpulayer_runtime.settings import number_option


def cmd_schema(args: argparse.Namespace) -> int:
    # The same text as docs/schemas/<name>.json.
    print(json.dumps(wire_schema(args.name), indent=2))
    return 0


def cmd_dev_up(args: argparse.Namespace) -> int:
    from gpulayer_cli.dev import run_dev

    return run_dev(
        once=args.once,
        examples_dir=Path(args.examples),
        data_dir=Path(args.data_dir),
        timeout_s=args.timeout,
        console=common.console(),
        auth=not args.no_auth,
    )


def cmd_check(args: argparse.Namespace) -> int:
    from gpulayer_cli.check import run_check

    return int(
        run_check(
            args.file,
            python=args.python,
            as_json=args.json,
            console=common.console(),
            profiles=_profiles_file(args),
        )
    )


def _profiles_file(args: argparse.Namespace) -> str | None:
    """The profiles file a job file's ``profile`` is expanded from: --profiles, else the
    GPULAYER_PROFILES placement reads."""
    return str(args.profiles or os.environ.get("GPULAYER_PROFILES") or "") or None


def cmd_conform(args: argparse.Namespace) -> int:
    from gpulayer_cli.conform import run_conform

    return int(
        run_conform(
            args.file,
            golden=args.golden,
            update=args.update,
            python=args.python,
            profiles=_profiles_file(args),
            as_json=args.json,
            console=common.console(),
            environ=os.environ,
        )
    )


def add_dev(sub: Any) -> None:
    dev = sub.add_parser("dev", help="run the whole stack on this machine")
    dev_sub = dev.add_subparsers(dest="dev_command", required=True)
    up = dev_sub.add_parser(
        "up", help="start NATS, PostgreSQL and the services; submit the examples"
    )
    up.add_argument(
        "--once", action="store_true", help="exit after the examples end (0 when as expected)"
    )
    up.add_argument("--examples", default="examples", help="folder of example job files")
    up.add_argument("--data-dir", default=".gpulayer", help="where servers keep their data")
    up.add_argument(
        "--timeout", type=number_option(), default=120.0, help="seconds to wait for the examples"
    )
    up.add_argument(
        "--no-auth",
        action="store_true",
        help="NATS without credentials: anyone who reaches it may do anything (GPULAYER_AUTH=off)",
    )
    up.set_defaults(fn=cmd_dev_up)


def add_schema(sub: Any) -> None:
    sc = sub.add_parser("schema", help="print the JSON Schema of a message (default: job request)")
    sc.add_argument("name", nargs="?", default="job", choices=list(WIRE_SCHEMAS))
    sc.set_defaults(fn=cmd_schema)


def add_check(sub: Any) -> None:
    ck = sub.add_parser(
        "check", help="would this machine get this job? (0 yes, 1 no, 2 invalid job file)"
    )
    ck.add_argument("file")
    ck.add_argument("--python", default=None, help="workload interpreter to probe")
    ck.add_argument("--json", action="store_true")
    ck.add_argument(
        "--profiles",
        default=None,
        help="profiles file for a job naming a profile (GPULAYER_PROFILES)",
    )
    ck.set_defaults(fn=cmd_check)


def add_conform(sub: Any) -> None:
    cf = sub.add_parser(
        "conform",
        help="run a job here and compare its output with the golden for this node class "
        "(0 passed or skipped, 1 mismatch or failure, 2 invalid input)",
    )
    cf.add_argument("file")
    cf.add_argument(
        "--golden", default=None, help="folder of goldens (default: <job file stem>.golden)"
    )
    cf.add_argument("--update", action="store_true", help="write this node class's golden")
    cf.add_argument("--python", default=None, help="workload interpreter to probe")
    cf.add_argument(
        "--profiles",
        default=None,
        help="profiles file for a job naming a profile (GPULAYER_PROFILES)",
    )
    cf.add_argument("--json", action="store_true")
    cf.set_defaults(fn=cmd_conform)
