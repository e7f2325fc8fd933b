"""``gpulayer``: one command line for people using and running gpulayer.

Exit codes: 0 success; 1 the thing asked about failed (a job failed, a check said no);
2 bad input (an invalid job file, a bad argument); 3 gpulayer unreachable; 4 permission
denied (the credential's role may not do this: docs/security.md, the role table).

This module only builds the parser and dispatches; each command group lives in a module of
its own: ``submit_cmd``, ``jobs_cmd`` (jobs, services, job, explain, cancel, logs),
``fleet_cmd`` (nodes, doctor, matrix, profiles), ``admin_cmd`` (keys, quota, dlq, node),
``audit_cmd`` (audit), ``auth_cmd`` and ``local_cmd`` (dev, schema, check, conform); what they share is in ``common``.
"""

from __future__ import annotations

import argparse
import sys

from gpulayer_cli import admin_cmd, audit_cmd, fleet_cmd, jobs_cmd, local_cmd, submit_cmd
from gpulayer_contracts import __version__


def build_parser() -> argparse.ArgumentParser:
    # Imported here: `gpulayer probe` never builds this parser, nor pays for runtime.auth.
    from gpulayer_cli import auth_cmd

    p = argparse.ArgumentParser(prog="gpulayer", description="GPU-aware job placement over NATS.")
    p.add_argument("--version", action="version", version=f"gpulayer {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    # In the order --help lists them.
    local_cmd.add_dev(sub)
    auth_cmd.add_parser(sub)
    admin_cmd.add_keys(sub)
    local_cmd.add_schema(sub)
    submit_cmd.add_submit(sub)
    fleet_cmd.add_nodes(sub)
    fleet_cmd.add_doctor(sub)
    admin_cmd.add_node(sub)
    jobs_cmd.add_jobs(sub)
    jobs_cmd.add_services(sub)
    jobs_cmd.add_job(sub)
    jobs_cmd.add_explain(sub)
    admin_cmd.add_quota(sub)
    jobs_cmd.add_cancel(sub)
    fleet_cmd.add_matrix(sub)
    # Listed for --help; main() hands `gpulayer probe ...` to the probe's own parser.
    sub.add_parser(
        "probe", help="detect this machine's capabilities as JSON (gpulayer probe --help)"
    )
    jobs_cmd.add_logs(sub)
    admin_cmd.add_dlq(sub)
    audit_cmd.add_audit(sub)
    local_cmd.add_check(sub)
    local_cmd.add_conform(sub)
    fleet_cmd.add_profiles(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["probe"]:
        # The probe has its own options (--python, --gpu-apis, ...): hand them over untouched.
        from gpulayer_detection.cli import main as probe_main

        return int(probe_main(argv[1:]))
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
