"""The credentials an auth folder has minted, as ``gpulayer auth list`` shows them, and what a
revoke did. Read from ``.creds`` files and the folder's index (``auth.AuthStore``)."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import msgspec

from gpulayer_runtime.roles import ROLES

# The tag a user JWT carries naming its role (``gpulayer-role:user``).
ROLE_TAG = "gpulayer-role:"


def decode_jwt_claims(token: str) -> dict[str, Any]:
    """The claims of a JWT, unverified (for display and tests)."""
    payload = token.split(".")[1]
    claims: dict[str, Any] = json.loads(
        base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
    )
    return claims


class Credential(msgspec.Struct, frozen=True, kw_only=True):
    """One credential minted in an auth folder (times: unix seconds)."""

    role: str
    name: str
    public_key: str
    issued: int
    expires: int | None = None
    revoked: int | None = None

    def state(self, now: float) -> str:
        if self.revoked is not None:
            return "revoked"
        if self.expires is not None and self.expires <= now:
            return "expired"
        return "valid"


class Revoked(msgspec.Struct, frozen=True, kw_only=True):
    """What ``AuthStore.revoke`` did: the credentials it revoked, and the account JWT (signed
    anew, in ``server.conf`` already) that the running servers must be given."""

    credentials: list[Credential]
    account_jwt: str


def credential_of(path: Path) -> Credential | None:
    """The credential a gpulayer ``.creds`` file holds; None for one that is not gpulayer's."""
    try:
        lines = path.read_text().splitlines()
        claims = decode_jwt_claims(lines[lines.index("-----BEGIN NATS USER JWT-----") + 1])
    except (OSError, ValueError, IndexError):
        return None
    role = next(
        (r for t in claims.get("nats", {}).get("tags") or [] for r in ROLES if t == ROLE_TAG + r),
        None,
    )
    if role is None or not isinstance(claims.get("sub"), str):
        return None
    expires = claims.get("exp")
    return Credential(
        role=role,
        name=str(claims.get("name", "")),
        public_key=claims["sub"],
        issued=int(claims.get("iat", 0)),
        expires=int(expires) if isinstance(expires, int) else None,
    )
