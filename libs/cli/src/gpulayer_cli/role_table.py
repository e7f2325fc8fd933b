"""Who may do what: for every ``gpulayer`` command and placement API verb, and each role whose
credential a person holds, what happens.

- ``works``: it does what it says (exit status as documented for the command);
- ``partial``: it works with less, and says on stderr which permission it lacks (exit 0 or as
  the command's answer);
- ``denied``: it exits with status 4 (``EXIT_DENIED``) and one line naming the permission it
  lacks: the subject NATS refused (publish or subscribe) or the right placement refused;
- ``local``: it never talks to NATS, so the role doesn't matter.

docs/security.md shows ``markdown()`` (tests/unit/test_role_table_doc.py checks the page, and that
every command and API verb is here); tests/e2e/test_role_table.py walks every cell over a real
stack with real credentials. ``python -m gpulayer_cli.role_table`` prints the table.
"""

from __future__ import annotations

from typing import Literal

import msgspec

Outcome = Literal["works", "partial", "denied", "local"]
# The roles a person's credential has (placement's is the service's own). A new role gets a
# column here: the unit test fails until it has one.
ROLES_SHOWN: tuple[str, ...] = ("user", "viewer", "admin", "node")


class Row(msgspec.Struct, frozen=True, kw_only=True):
    """One command (``kind`` "cli": its argv after ``gpulayer``) or API verb (``kind`` "api")
    in one situation (``case``, the key the e2e test walks it by)."""

    kind: Literal["cli", "api"]
    case: str
    command: str
    uses: str
    user: Outcome
    viewer: Outcome
    admin: Outcome
    node: Outcome
    note: str = ""

    def outcome(self, role: str) -> Outcome:
        value: Outcome = getattr(self, role)
        return value


def _cli(case: str, command: str, uses: str, user: Outcome, viewer: Outcome, note: str = "") -> Row:
    """A command that talks to NATS: admins may do it, a node's credential may not (it has no
    user name to ask placement's API as, and no right on jobs or the API)."""
    return Row(
        kind="cli",
        case=case,
        command=command,
        uses=uses,
        user=user,
        viewer=viewer,
        admin="works",
        node="denied",
        note=note,
    )


def _local(case: str, command: str, note: str = "") -> Row:
    return Row(
        kind="cli",
        case=case,
        command=command,
        uses="no NATS",
        user="local",
        viewer="local",
        admin="local",
        node="local",
        note=note,
    )


def _api(verb: str, user: Outcome, viewer: Outcome, whose: str = "", note: str = "") -> Row:
    """A placement API verb; ``whose``: "own" or "other" for a verb about one job."""
    return Row(
        kind="api",
        case=f"api-{verb}" + (f"-{whose}" if whose else ""),
        command=verb + {"": "", "own": " (own job)", "other": " (another user's job)"}[whose],
        uses=f"`gpulayer.api.{verb}.<caller>`",
        user=user,
        viewer=viewer,
        admin="works",
        node="denied",
        note=note,
    )


_EVENTS = "API job, `$JS.API.CONSUMER.CREATE.JOB_EVENTS.*.gpulayer.job.<owner>.<job>.events`"
_LOGS = "`$JS.API.CONSUMER.CREATE.LOGS.*.gpulayer.job.<owner>.<job>.logs`"

TABLE: tuple[Row, ...] = (
    _cli(
        "submit",
        "submit FILE",
        "`gpulayer.jobs.submit.<user>`, API job",
        "works",
        "denied",
        "a viewer reads, never submits",
    ),
    _cli("nodes", "nodes [--devices]", "API nodes", "works", "works"),
    _cli(
        "doctor",
        "doctor NODE",
        "`gpulayer.node.<node>.doctor` (request to the probe)",
        "partial",
        "partial",
        "re-detection is for admins: a user or viewer gets the node's last health from "
        "placement, after a line naming the doctor subject it may not publish to",
    ),
    _cli("doctor-last", "doctor NODE --last", "API nodes", "works", "works"),
    _cli("jobs", "jobs", "API jobs", "works", "works"),
    _cli("services", "services", "API services", "works", "works"),
    _cli(
        "job-own",
        "job JOB (own job)",
        _EVENTS,
        "works",
        "works",
        "a viewer owns no job: any job's, env values `<redacted>`, its events shown",
    ),
    _cli(
        "job-other",
        "job JOB (another user's job)",
        _EVENTS,
        "partial",
        "works",
        "a user gets the record with env values `<redacted>` and, instead of the events, a "
        "line naming the consumer subject it may not publish to; a viewer reads any job's "
        "events (env values `<redacted>` too)",
    ),
    _cli("explain", "explain JOB (any job)", "API explain", "works", "works"),
    _cli(
        "cancel-own",
        "cancel JOB (own job)",
        "API cancel",
        "works",
        "denied",
        "a viewer may not ask the cancel verb at all",
    ),
    _cli(
        "cancel-other",
        "cancel JOB (another user's job)",
        "API cancel",
        "denied",
        "denied",
        "placement refuses a user: only the job's owner or an admin may cancel it",
    ),
    _cli("logs-own", "logs JOB (own job)", _LOGS, "works", "denied", "a viewer reads no logs"),
    _cli(
        "logs-other",
        "logs JOB (another user's job)",
        _LOGS,
        "denied",
        "denied",
        "only the job's owner and admins read its logs",
    ),
    _cli("quota-list", "quota list", "API quota", "works", "works"),
    _cli(
        "quota-set",
        "quota set OWNER ...",
        "API quota",
        "denied",
        "denied",
        "placement refuses: only admins (GPULAYER_ADMINS) may change quotas",
    ),
    _cli(
        "dlq",
        "dlq",
        "`$JS.API.STREAM.INFO.DLQ`, `$JS.API.STREAM.MSG.GET.DLQ`",
        "denied",
        "denied",
        "the dead letters are for admins",
    ),
    _cli(
        "audit",
        "audit",
        "`$JS.API.STREAM.INFO.AUDIT`, a consumer on AUDIT",
        "denied",
        "denied",
        "the audit trail is for admins",
    ),
    _cli(
        "node-forget",
        "node forget NAME",
        "API node",
        "denied",
        "denied",
        "placement refuses a user: only admins (GPULAYER_ADMINS) may forget a node",
    ),
    _cli("profiles", "profiles", "API profiles", "works", "works"),
    _local("matrix", "matrix", "this version's support matrix"),
    _local("schema", "schema [NAME]"),
    _local("check", "check FILE", "this machine's own probe"),
    _local("conform", "conform FILE", "runs the job here"),
    _local("probe", "probe"),
    _local("keys", "keys generate DIR"),
    _local("auth", "auth ...", "needs the auth folder's signing key (a file), not a role"),
    _local("dev", "dev up", "starts its own stack"),
    _api("nodes", "works", "works"),
    _api("jobs", "works", "works"),
    _api("job", "works", "works", "own", "a viewer's: any job, env values `<redacted>`"),
    _api("job", "partial", "partial", "other", "env values of another's job are `<redacted>`"),
    _api("explain", "works", "works"),
    _api("cancel", "works", "denied", "own", "a viewer may not publish on the cancel verb"),
    _api("cancel", "denied", "denied", "other", "placement refuses: only the owner or an admin"),
    _api("matrix", "works", "works"),
    _api("profiles", "works", "works"),
    _api("services", "works", "works"),
    _api("quota", "works", "works", note="the list; set and delete: admins only (as quota set)"),
    _api("node", "denied", "denied", note="placement refuses a user; a viewer may not ask it"),
)


def markdown() -> str:
    """The table as docs/security.md shows it."""
    head = ["command", "uses", *ROLES_SHOWN, "note"]
    lines = [
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for row in TABLE:
        what, _, when = row.command.partition(" (")
        command = (f"`gpulayer {what}`" if row.kind == "cli" else f"API {what}") + (
            f" ({when}" if when else ""
        )
        cells = [row.outcome(role) for role in ROLES_SHOWN]
        lines.append("| " + " | ".join([command, row.uses, *cells, row.note]) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
