"""NATS decentralized auth for gpulayer: an operator, a system account, one application account
``GPULAYER`` (JetStream on), and a user credential per identity, carrying its role's permissions.

Keys are nkeys (nats-io's own ed25519 library). The JWTs are encoded here, over nkeys: the
format is small (a fixed header, JSON claims, an ed25519 signature, all base64url), and the
one Python package for it (nats-jwt) calls itself untested and pins old dependencies. The real
check that the encoding is right is that nats-server accepts it (tests/integration/test_auth.py).

Layout of an auth folder (everything ``0600``, the folder ``0700``)::

    operator.nk  system.nk  account.nk    the identity keys (seeds)
    signing.nk                            the account signing key: all that minting needs
    server.conf                           what nats-server includes: operator, resolver
    creds/<role>-<name>.creds             one per identity (placement: creds/placement.creds)
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import nkeys

from gpulayer_runtime.roles import ROLES, Permissions, Role, check_name, permissions

ACCOUNT_NAME = "GPULAYER"
_HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
_NO_LIMIT = -1


class AuthError(RuntimeError):
    pass


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def new_seed(prefix: int) -> bytes:
    """A fresh nkey seed of the given kind (``nkeys.PREFIX_BYTE_USER`` ...)."""
    return bytes(nkeys.encode_seed(os.urandom(32), prefix))


def public_key(seed: bytes) -> str:
    return str(nkeys.from_seed(bytearray(seed)).public_key.decode())


def encode_jwt(claims: dict[str, Any], signer_seed: bytes) -> str:
    """A NATS JWT: ``claims`` (``iss`` set to the signer, ``jti`` and ``iat`` filled in) signed
    with ``signer_seed``."""
    kp = nkeys.from_seed(bytearray(signer_seed))
    body = {**claims, "iat": int(time.time()), "iss": kp.public_key.decode()}
    # The id is the hash of the claims without it, as nats-io/jwt computes it.
    digest = hashlib.new("sha512_256", json.dumps(body, sort_keys=True).encode()).digest()
    body["jti"] = base64.b32encode(digest).rstrip(b"=").decode()
    head = _b64(json.dumps(_HEADER, separators=(",", ":")).encode())
    payload = _b64(json.dumps(body, separators=(",", ":")).encode())
    signature = kp.sign(f"{head}.{payload}".encode())
    return f"{head}.{payload}.{_b64(bytes(signature))}"


def decode_jwt_claims(token: str) -> dict[str, Any]:
    """The claims of a JWT, unverified (for display and tests)."""
    payload = token.split(".")[1]
    claims: dict[str, Any] = json.loads(
        base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
    )
    return claims


def _account_limits(jetstream: bool) -> dict[str, Any]:
    limits: dict[str, Any] = {
        "subs": _NO_LIMIT,
        "data": _NO_LIMIT,
        "payload": _NO_LIMIT,
        "imports": _NO_LIMIT,
        "exports": _NO_LIMIT,
        "wildcards": True,
        "conn": _NO_LIMIT,
        "leaf": _NO_LIMIT,
    }
    if jetstream:
        limits |= {"mem_storage": _NO_LIMIT, "disk_storage": _NO_LIMIT}
        limits |= {"streams": _NO_LIMIT, "consumer": _NO_LIMIT}
    return limits


_ROLE_TAG = "gpulayer-role:"


def user_claims(
    user_public: str, account_public: str, role: Role, name: str, perms: Permissions
) -> dict[str, Any]:
    nats: dict[str, Any] = {
        # Read back by clients to choose their inbox prefix (``identity_of``).
        "tags": [f"{_ROLE_TAG}{role}"],
        "pub": {"allow": list(perms.publish)},
        "sub": {"allow": list(perms.subscribe)},
        "subs": _NO_LIMIT,
        "data": _NO_LIMIT,
        "payload": _NO_LIMIT,
        "issuer_account": account_public,
        "type": "user",
        "version": 2,
    }
    if perms.allow_responses:
        # One reply per request, within the server's default time.
        nats["resp"] = {"max": 1, "ttl": 0}
    return {"sub": user_public, "name": name, "nats": nats}


def identity_of(creds: str | Path) -> tuple[Role, str] | None:
    """The role and name a gpulayer ``.creds`` file was minted for; None for credentials made
    elsewhere (they keep nats-py's default inbox prefix)."""
    try:
        text = Path(creds).read_text()
    except OSError as err:
        raise AuthError(f"cannot read NATS credentials {creds}: {err.strerror}") from None
    lines = text.splitlines()
    try:
        jwt = lines[lines.index("-----BEGIN NATS USER JWT-----") + 1].strip()
        claims = decode_jwt_claims(jwt)
    except (ValueError, IndexError):
        raise AuthError(f"{creds} is not a NATS .creds file") from None
    tags = claims.get("nats", {}).get("tags") or []
    for tag in tags:
        for role in ROLES:
            if tag == f"{_ROLE_TAG}{role}":
                return role, str(claims.get("name", ""))
    return None


def format_creds(jwt: str, seed: bytes) -> str:
    """The ``.creds`` file format nats clients read (``user_credentials``)."""
    return (
        "-----BEGIN NATS USER JWT-----\n"
        f"{jwt}\n"
        "------END NATS USER JWT------\n\n"
        "************************* IMPORTANT *************************\n"
        "NKEY Seed printed below can be used to sign and prove identity.\n"
        "NKEYs are sensitive and should be treated as secrets.\n\n"
        "-----BEGIN USER NKEY SEED-----\n"
        f"{seed.decode()}\n"
        "------END USER NKEY SEED------\n\n"
        "*************************************************************\n"
    )


def _write_private(path: Path, data: str | bytes) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    # Created 0600 from the start: never readable by others, even for a moment.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    os.chmod(path, 0o600)


def creds_name(role: Role, name: str) -> str:
    return "placement.creds" if role == "placement" else f"{role}-{name}.creds"


class AuthStore:
    """The operator, accounts and minted credentials kept in one folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder).absolute()

    @property
    def server_conf(self) -> Path:
        return self.folder / "server.conf"

    def creds_path(self, role: Role, name: str = "") -> Path:
        return self.folder / "creds" / creds_name(role, name)

    def exists(self) -> bool:
        return (self.folder / "signing.nk").exists() and self.server_conf.exists()

    def _seed(self, name: str) -> bytes:
        try:
            return (self.folder / f"{name}.nk").read_bytes().strip()
        except FileNotFoundError:
            raise AuthError(
                f"{self.folder / (name + '.nk')} is missing: not an auth folder made by "
                "`gpulayer auth init` (or `gpulayer dev up`)"
            ) from None

    def init(self) -> AuthStore:
        """Create the operator and accounts once; later calls keep what exists."""
        if self.exists():
            return self
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.folder, 0o700)
        seeds = {
            "operator": new_seed(nkeys.PREFIX_BYTE_OPERATOR),
            "system": new_seed(nkeys.PREFIX_BYTE_ACCOUNT),
            "account": new_seed(nkeys.PREFIX_BYTE_ACCOUNT),
            "signing": new_seed(nkeys.PREFIX_BYTE_ACCOUNT),
        }
        for name, seed in seeds.items():
            _write_private(self.folder / f"{name}.nk", seed)
        _write_private(self.server_conf, self._server_conf(seeds))
        return self

    def _server_conf(self, seeds: dict[str, bytes]) -> str:
        op = seeds["operator"]
        system_pub, account_pub = public_key(seeds["system"]), public_key(seeds["account"])
        operator_jwt = encode_jwt(
            {
                "sub": public_key(op),
                "name": "gpulayer",
                "nats": {"system_account": system_pub, "type": "operator", "version": 2},
            },
            op,
        )
        system_jwt = encode_jwt(
            {
                "sub": system_pub,
                "name": "SYS",
                "nats": {"limits": _account_limits(False), "type": "account", "version": 2},
            },
            op,
        )
        account_jwt = encode_jwt(
            {
                "sub": account_pub,
                "name": ACCOUNT_NAME,
                "nats": {
                    "limits": _account_limits(True),
                    # Users are signed by this key, so the account's own key can stay offline.
                    "signing_keys": [public_key(seeds["signing"])],
                    "type": "account",
                    "version": 2,
                },
            },
            op,
        )
        return (
            "# Generated by gpulayer: NATS decentralized auth (operator mode). Users are minted\n"
            "# with `gpulayer auth add-node|add-user|add-admin`, never by editing this file.\n"
            f"operator: {operator_jwt}\n"
            f"system_account: {system_pub}\n"
            "resolver: MEMORY\n"
            "resolver_preload: {\n"
            f"  {system_pub}: {system_jwt}\n"
            f"  {account_pub}: {account_jwt}\n"
            "}\n"
        )

    def mint(self, role: Role, name: str = "") -> Path:
        """Write (or rewrite) the credential of identity ``name`` in ``role``; returns its path.
        Needs only the account's signing key. Refuses a user, an admin or a viewer of one name, since
        the API knows its callers by name."""
        if role == "placement":
            name = "placement"
        else:
            check_name(name, f"{role} name")
        # The API knows a caller by name alone: one name is one user, admin or viewer.
        named: tuple[Role, ...] = ("user", "admin", "viewer")
        for other in named if role in named else ():
            if other != role and self.creds_path(other, name).exists():
                article = "an" if other == "admin" else "a"
                raise AuthError(f"{name!r} is already {article} {other}: pick another name")
        perms = permissions(role, name)
        user_seed = new_seed(nkeys.PREFIX_BYTE_USER)
        account_pub = public_key(self._seed("account"))
        claims = user_claims(public_key(user_seed), account_pub, role, name, perms)
        jwt = encode_jwt(claims, self._seed("signing"))
        path = self.creds_path(role, name)
        _write_private(path, format_creds(jwt, user_seed))
        return path

    def ensure(self, role: Role, name: str = "") -> Path:
        """The identity's credential, minted when missing."""
        path = self.creds_path(role, name)
        return path if path.exists() else self.mint(role, name)
