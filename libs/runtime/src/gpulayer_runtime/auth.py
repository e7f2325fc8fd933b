"""NATS decentralized auth for gpulayer: an operator, a system account, one application account
``GPULAYER`` (JetStream on), and a user credential per identity, carrying its role's permissions.

Keys are nkeys (nats-io's own ed25519 library). The JWTs are encoded here, over nkeys: the
format is small (a fixed header, JSON claims, an ed25519 signature, all base64url), and the
one Python package for it (nats-jwt) calls itself untested and pins old dependencies. The real
check that the encoding is right is that nats-server accepts it (tests/integration/test_auth.py).

Layout of an auth folder (everything ``0600``, the folder ``0700``)::

    operator.nk  system.nk  account.nk    the identity keys (seeds)
    signing.nk                            the account signing key: all that minting needs
    account.jwt                           the GPULAYER account as last signed (its revocations)
    server.conf                           what nats-server includes: operator, resolver
    creds/<role>-<name>.creds             one per identity (placement: creds/placement.creds)
    identities.json                       every credential ever minted here: role, name, key,
                                          issued, expires, revoked (``gpulayer auth list``)

Revocation: the account JWT lists revoked user keys (``revocations``: key -> unix time, a
credential issued at or before it is refused). ``revoke`` re-signs it with the operator key and
rewrites ``server.conf``; ``push_account`` hands it to the running servers on the system
account's claims-update subject. The resolver is ``full`` (a folder of account JWTs per
server), not ``MEMORY``: a memory resolver applies such an update only to an account the server
has loaded already ("jwt update skipped" otherwise) and keeps the preloaded JWT, which a later
lookup would use, revocations lost; a full resolver stores the update and applies it.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import nkeys

from gpulayer_runtime.credentials import ROLE_TAG, Credential, Revoked, credential_of
from gpulayer_runtime.credentials import decode_jwt_claims as decode_jwt_claims
from gpulayer_runtime.private_files import write_private
from gpulayer_runtime.roles import ROLES, Permissions, Role, check_name, permissions

ACCOUNT_NAME = "GPULAYER"
_HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
_NO_LIMIT = -1


class AuthError(RuntimeError):
    pass


class KeyUnavailable(AuthError):
    """A key the operation signs with is not in (or not readable from) the auth folder: the
    caller is not who may do it."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def new_seed(prefix: int) -> bytes:
    """A fresh nkey seed of the given kind (``nkeys.PREFIX_BYTE_USER`` ...)."""
    return bytes(nkeys.encode_seed(os.urandom(32), prefix))


def public_key(seed: bytes) -> str:
    return str(nkeys.from_seed(bytearray(seed)).public_key.decode())


def encode_jwt(claims: dict[str, Any], signer_seed: bytes) -> str:
    """A NATS JWT: ``claims`` (``iss`` set to the signer, ``jti`` filled in, ``iat`` unless
    given) signed with ``signer_seed``."""
    kp = nkeys.from_seed(bytearray(signer_seed))
    body = {"iat": int(time.time()), **claims, "iss": kp.public_key.decode()}
    # The id is the hash of the claims without it, as nats-io/jwt computes it.
    digest = hashlib.new("sha512_256", json.dumps(body, sort_keys=True).encode()).digest()
    body["jti"] = base64.b32encode(digest).rstrip(b"=").decode()
    head = _b64(json.dumps(_HEADER, separators=(",", ":")).encode())
    payload = _b64(json.dumps(body, separators=(",", ":")).encode())
    signature = kp.sign(f"{head}.{payload}".encode())
    return f"{head}.{payload}.{_b64(bytes(signature))}"


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


_KEY_USE = {
    "operator": "operator key (it signs the account: revoking)",
    "signing": "account signing key (minting)",
    "system": "system account key (updating the running servers)",
}


def user_claims(
    user_public: str, account_public: str, role: Role, name: str, perms: Permissions
) -> dict[str, Any]:
    nats: dict[str, Any] = {
        # Read back by clients to choose their inbox prefix (``identity_of``).
        "tags": [f"{ROLE_TAG}{role}"],
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
            if tag == f"{ROLE_TAG}{role}":
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
    # 0600 from its creation, and moved in whole: a server starting meanwhile reads the old
    # server.conf or the new one, never a part.
    write_private(path, data.decode() if isinstance(data, bytes) else data)


def creds_name(role: Role, name: str) -> str:
    return "placement.creds" if role == "placement" else f"{role}-{name}.creds"


# The longest lifetime ``--expires`` accepts: past any rotation policy, and still a plain
# integer of seconds in every JWT library.
MAX_EXPIRES_S = 10 * 365 * 86400
INDEX = "identities.json"
# Where each server's account resolver keeps the account JWTs: relative to its working
# directory, so every server has its own.
RESOLVER_DIR = "./accounts"


class AuthStore:
    """The operator, accounts and minted credentials kept in one folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder).absolute()

    @property
    def server_conf(self) -> Path:
        return self.folder / "server.conf"

    @property
    def account_jwt_path(self) -> Path:
        return self.folder / "account.jwt"

    def creds_path(self, role: Role, name: str = "") -> Path:
        return self.folder / "creds" / creds_name(role, name)

    def exists(self) -> bool:
        return (self.folder / "signing.nk").exists() and self.server_conf.exists()

    def _seed(self, name: str) -> bytes:
        path = self.folder / f"{name}.nk"
        try:
            return path.read_bytes().strip()
        except OSError as err:
            why = "is missing" if isinstance(err, FileNotFoundError) else f": {err.strerror}"
            raise KeyUnavailable(
                f"{path} {why}: this needs the {_KEY_USE.get(name, name + ' key')}, which only "
                "the admins holding the auth folder (`gpulayer auth init`, `dev up`) have"
            ) from None

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """One writer at a time: two `gpulayer auth` runs at once must not lose an index entry
        or a revocation."""
        try:
            fd = os.open(self.folder / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as err:
            raise AuthError(f"cannot write in {self.folder}: {err.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def init(self) -> AuthStore:
        """Create the operator and accounts once; later calls keep what exists (a
        ``server.conf`` of an older gpulayer, with a memory resolver, is rewritten: the same
        keys, a resolver that takes revocations live)."""
        if self.exists() and "resolver: MEMORY" not in self.server_conf.read_text():
            return self
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Two first runs at once (two `dev up`, an `auth init` beside one) make one operator:
        # the second finds the first's under the lock.
        with self._locked():
            if self.exists():
                if "resolver: MEMORY" in self.server_conf.read_text():
                    self._write_account(self._revocations(self.credentials()))
                return self
            self._create()
        return self

    def _create(self) -> None:
        os.chmod(self.folder, 0o700)
        seeds = {
            "operator": new_seed(nkeys.PREFIX_BYTE_OPERATOR),
            "system": new_seed(nkeys.PREFIX_BYTE_ACCOUNT),
            "account": new_seed(nkeys.PREFIX_BYTE_ACCOUNT),
            "signing": new_seed(nkeys.PREFIX_BYTE_ACCOUNT),
        }
        for name, seed in seeds.items():
            _write_private(self.folder / f"{name}.nk", seed)
        self._write_account({})

    def _sign_account(self, revocations: dict[str, int]) -> str:
        nats: dict[str, Any] = {
            "limits": _account_limits(True),
            # Users are signed by this key, so the account's own key can stay offline.
            "signing_keys": [public_key(self._seed("signing"))],
            "type": "account",
            "version": 2,
        }
        if revocations:
            nats["revocations"] = revocations
        claims = {"sub": public_key(self._seed("account")), "name": ACCOUNT_NAME, "nats": nats}
        return encode_jwt(claims, self._seed("operator"))

    def _write_account(self, revocations: dict[str, int]) -> str:
        """Sign the account with ``revocations`` and write it where servers read it: its own
        file and ``server.conf``'s preload (what a restarted server starts from)."""
        account_jwt = self._sign_account(revocations)
        _write_private(self.account_jwt_path, account_jwt + "\n")
        _write_private(self.server_conf, self._server_conf(account_jwt))
        return account_jwt

    def account_jwt(self) -> str:
        """The account JWT as last signed (what ``server.conf`` preloads)."""
        try:
            return self.account_jwt_path.read_text().strip()
        except FileNotFoundError:
            with self._locked():
                return self._write_account(self._revocations(self.credentials()))
        except OSError as err:
            raise AuthError(f"cannot read {self.account_jwt_path}: {err.strerror}") from None

    def _server_conf(self, account_jwt: str) -> str:
        op = self._seed("operator")
        system_seed = self._seed("system")
        system_pub, account_pub = public_key(system_seed), public_key(self._seed("account"))
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
        return (
            "# Generated by gpulayer: NATS decentralized auth (operator mode). Users are minted\n"
            "# with `gpulayer auth add-node|add-user|add-admin`, revoked with `gpulayer auth\n"
            "# revoke`, never by editing this file.\n"
            f"operator: {operator_jwt}\n"
            f"system_account: {system_pub}\n"
            "# The account JWTs a server has, in a folder of its own: relative to the server's\n"
            "# working directory, so give each server its own (EmbeddedNats runs each in its\n"
            "# data folder; deploy/compose.yaml sets working_dir: /data). Updates (revocations)\n"
            "# arrive on the system account and are kept there; the preload below is the\n"
            "# starting point, taken when newer than what the folder has.\n"
            f'resolver: {{type: full, dir: "{RESOLVER_DIR}", allow_delete: false, interval: "2m"}}\n'
            "resolver_preload: {\n"
            f"  {system_pub}: {system_jwt}\n"
            f"  {account_pub}: {account_jwt}\n"
            "}\n"
        )

    def _load_index(self) -> list[Credential]:
        path = self.folder / INDEX
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as err:
            raise AuthError(f"cannot read {path}: {err.strerror}") from None
        try:
            return msgspec.json.decode(data, type=list[Credential])
        except msgspec.DecodeError as err:
            raise AuthError(f"{path} is damaged ({err}): restore it from a backup") from None

    def credentials(self) -> list[Credential]:
        """Every credential minted here, oldest first, with the ones on disk that the index
        lacks (minted by a gpulayer before it kept one) adopted."""
        index = self._load_index()
        known = {c.public_key for c in index}
        on_disk = sorted((self.folder / "creds").glob("*.creds"))
        adopted = [c for p in on_disk if (c := credential_of(p)) and c.public_key not in known]
        return index + adopted

    def _save_index(self, credentials: list[Credential]) -> None:
        _write_private(self.folder / INDEX, msgspec.json.format(msgspec.json.encode(credentials)))

    @staticmethod
    def _revocations(credentials: list[Credential]) -> dict[str, int]:
        return {c.public_key: c.revoked for c in credentials if c.revoked is not None}

    def mint(self, role: Role, name: str = "", *, expires_s: int | None = None) -> Path:
        """Write (or rewrite) the credential of identity ``name`` in ``role``; returns its path.
        ``expires_s``: seconds it stays valid (None: until revoked). Needs only the account's
        signing key. Refuses a user, an admin or a viewer of one name, since the API knows its
        callers by name."""
        if role == "placement":
            name = "placement"
        else:
            check_name(name, f"{role} name")
        if expires_s is not None and not 0 < expires_s <= MAX_EXPIRES_S:
            raise ValueError(
                f"expiry of {expires_s}s: give more than 0 and at most {MAX_EXPIRES_S}s (10 years)"
            )
        # The API knows a caller by name alone: one name is one user, admin or viewer.
        named: tuple[Role, ...] = ("user", "admin", "viewer")
        for other in named if role in named else ():
            if other != role and self.creds_path(other, name).exists():
                article = "an" if other == "admin" else "a"
                raise AuthError(f"{name!r} is already {article} {other}: pick another name")
        perms = permissions(role, name)
        user_seed = new_seed(nkeys.PREFIX_BYTE_USER)
        user_pub = public_key(user_seed)
        account_pub = public_key(self._seed("account"))
        claims = user_claims(user_pub, account_pub, role, name, perms)
        now = int(time.time())
        claims["iat"] = now
        if expires_s is not None:
            claims["exp"] = now + expires_s
        jwt = encode_jwt(claims, self._seed("signing"))
        path = self.creds_path(role, name)
        with self._locked():
            # Read before the file is replaced: a credential minted before the index existed
            # is adopted, so a later revoke still covers it.
            index = self.credentials()
            _write_private(path, format_creds(jwt, user_seed))
            record = Credential(
                role=role, name=name, public_key=user_pub, issued=now, expires=claims.get("exp")
            )
            self._save_index([*index, record])
        return path

    def ensure(self, role: Role, name: str = "") -> Path:
        """The identity's credential, minted when missing."""
        path = self.creds_path(role, name)
        return path if path.exists() else self.mint(role, name)

    def revoke(self, role: Role, name: str = "") -> Revoked:
        """Revoke every credential ever minted here for identity ``name`` in ``role`` (a
        re-minted identity's older ones too): they go into the account's revocations, the
        account is signed again (needs the operator key) and ``server.conf`` rewritten, and the
        identity's ``.creds`` file is removed. The running servers learn of it only from
        ``push_account``."""
        if role == "placement":
            name = "placement"
        # Both keys checked before anything is written: signing the account, then telling the
        # servers as the system account.
        self._seed("operator")
        self._seed("system")
        with self._locked():
            index = self.credentials()
            mine = [c for c in index if c.role == role and c.name == name]
            if not mine:
                raise AuthError(f"no {role} {name!r} was minted in {self.folder}")
            if all(c.revoked is not None for c in mine):
                raise AuthError(f"{role} {name!r} is revoked already (`gpulayer auth list`)")
            now = int(time.time())
            updated = [
                msgspec.structs.replace(c, revoked=now)
                if c.role == role and c.name == name and c.revoked is None
                else c
                for c in index
            ]
            account_jwt = self._write_account(self._revocations(updated))
            self._save_index(updated)
            with contextlib.suppress(FileNotFoundError):
                self.creds_path(role, name).unlink()
        revoked = [c for c, before in zip(updated, index, strict=True) if c != before]
        return Revoked(credentials=revoked, account_jwt=account_jwt)

    def system_creds(self, ttl_s: int = 120) -> str:
        """A short-lived credential of the system account, never written to disk: what
        ``push_account`` connects with."""
        seed = new_seed(nkeys.PREFIX_BYTE_USER)
        now = int(time.time())
        claims = {
            "sub": public_key(seed),
            "name": "gpulayer-auth",
            "iat": now,
            "exp": now + ttl_s,
            "nats": {"subs": _NO_LIMIT, "data": _NO_LIMIT, "payload": _NO_LIMIT,
                     "type": "user", "version": 2},
        }  # fmt: skip
        return format_creds(encode_jwt(claims, self._seed("system")), seed)
