"""The audit trail: who did what to which target, when, and how it ended.

Records go to ``gpulayer.audit.<action>`` (stream AUDIT), published by the service that acted
(placement: submits, cancels, quota changes, nodes forgotten) or by an admin's CLI
(credentials minted and revoked). Only placement and admins may publish there, so a user can't
forge a record. One message holds a list of records: placement sends one per batch of submits,
not one per job.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Literal

import msgspec

from gpulayer_contracts._base import Wire
from gpulayer_contracts.subjects import AUDIT_WILDCARD, PREFIX

__all__ = ["ACTIONS", "AUDIT_WILDCARD", "AuditRecord", "audit_decoder", "audit_subject"]

Action = Literal["submit", "cancel", "quota-set", "quota-delete", "mint", "revoke", "node-forget"]
ACTIONS: tuple[Action, ...] = (
    "submit",
    "cancel",
    "quota-set",
    "quota-delete",
    "mint",
    "revoke",
    "node-forget",
)

# Records a message holds at most: far under max_payload however long their fields are.
MAX_RECORDS_PER_MESSAGE = 200


def _now() -> datetime:
    return datetime.now(UTC)


class AuditRecord(Wire, frozen=True):
    """``identity``: who acted (a credential's name, ``anonymous`` without auth); ``role``:
    ``user``, ``admin`` or ``anonymous``; ``target``: a job id, a quota's owner, a credential's
    ``role name``, a node; ``outcome``: ``accepted``, ``rejected``, ``cancelled``, ``denied``,
    ``ok``, ``failed``; ``detail``: why, in words (a rejection's first reason, a quota's values,
    what forgetting a node released)."""

    at: datetime = msgspec.field(default_factory=_now)
    identity: str = ""
    role: str = ""
    action: Action = "submit"
    target: str = ""
    outcome: str = ""
    detail: str = ""


audit_decoder = msgspec.json.Decoder(list[AuditRecord])


def audit_subject(action: Action) -> str:
    return f"{PREFIX}.audit.{action}"
