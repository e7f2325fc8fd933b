"""Placement's signature on grants and cancels (ed25519), and the executor's check of it.

Placement signs the exact bytes it publishes, bound to what they are (a grant or a cancel), the
node they are for, the grant id, when they were issued and which key signed them. The signature
travels in NATS headers, so the executor verifies the payload as received and decodes it once,
never re-encoding anything. A signature copied onto another node's subject, onto another
message, or from a cancel onto a grant no longer verifies. A batch of messages is signed once,
over a hash tree of them (below), and each message still verifies alone.

Keys: a seed file (32 random bytes, base64url on one line, or an ed25519 PKCS#8 PEM as
``openssl genpkey -algorithm ed25519`` writes) for placement; public keys as base64url text
(43 characters) for executors, several at once so that keys can be rotated.

Pure functions and small classes; reading files and the environment stays with the callers.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import stat
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from gpulayer_runtime.private_files import write_private
from gpulayer_runtime.settings import ConfigError

# One header: KEYID.ISSUED_MS.SIGNATURE[.INDEX.SIZE.SIBLINGS], hex and decimal (``_Signed``).
SIGNATURE_HEADER = "Gpulayer-Signature"

Kind = Literal["grant", "cancel"]
_DOMAIN: dict[str, bytes] = {"grant": b"gpulayer-grant-v1", "cancel": b"gpulayer-cancel-v1"}

# A grant stays in GRANTS until its executor takes it, so a genuine one may be old when it is
# read (the executor was down). Replays of a grant the executor still has a record of are
# ignored whatever their age; this bound covers records pruned since (kept 7 days by default),
# so it must stay below the executor's record retention.
DEFAULT_MAX_AGE_S = 24 * 3600.0
# Clocks of placement and executor hosts differ a little; more than this is refused, since a
# date far ahead would stretch the window in which a copy could be replayed.
MAX_FUTURE_S = 300.0

RefusalReason = Literal[
    "unsigned", "malformed", "unknown_key", "bad_signature", "expired", "future", "wrong_node"
]


class SigningKeyError(ValueError):
    """A key or key file that can't be used; the message names what is wrong."""


@dataclass(frozen=True, slots=True)
class Refusal:
    reason: RefusalReason  # a short, fixed word: the metric's label
    detail: str  # for the log


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def key_id(public: Ed25519PublicKey) -> str:
    """A short name for a public key (16 hex digits of its SHA-256), sent with each signature so
    the executor picks the key without trying each."""
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def public_key_text(public: Ed25519PublicKey) -> str:
    """The public key as executors are given it (``GPULAYER_PLACEMENT_PUBLIC_KEYS``)."""
    return _b64(public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))


def parse_public_keys(text: str) -> list[Ed25519PublicKey]:
    """Comma-separated base64url public keys; a bad one is an error naming it."""
    keys = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            raw = _unb64(part)
        except (binascii.Error, ValueError):
            raise SigningKeyError(f"public key {part[:60]!r} is not base64url") from None
        if len(raw) != 32:
            raise SigningKeyError(
                f"public key {part[:60]!r} is {len(raw)} bytes, expected 32 (ed25519)"
            )
        keys.append(Ed25519PublicKey.from_public_bytes(raw))
    return keys


def seed_text(key: Ed25519PrivateKey) -> str:
    raw = key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    return _b64(raw)


def parse_seed(text: str) -> Ed25519PrivateKey:
    """A private key from a seed file's text: base64url of 32 bytes, or an ed25519 PKCS#8 PEM."""
    text = text.strip()
    if text.startswith("-----BEGIN"):
        try:
            key = serialization.load_pem_private_key(text.encode(), password=None)
        except (ValueError, TypeError) as err:
            raise SigningKeyError(f"not a usable PEM private key: {err}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise SigningKeyError(f"PEM key is {type(key).__name__}, expected an ed25519 key")
        return key
    try:
        raw = _unb64(text)
    except (binascii.Error, ValueError):
        raise SigningKeyError("seed is neither base64url nor PEM") from None
    if len(raw) != 32:
        raise SigningKeyError(f"seed is {len(raw)} bytes, expected 32")
    return Ed25519PrivateKey.from_private_bytes(raw)


def load_seed_file(path: Path) -> Ed25519PrivateKey:
    """Placement's signing key. Refused when others than its owner may read it (as ssh does)."""
    try:
        mode = path.stat().st_mode
        text = path.read_text()
    except OSError as err:
        raise SigningKeyError(f"{path}: {err.strerror or err}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SigningKeyError(f"{path}: mode {stat.S_IMODE(mode):04o}, must be 0600 (owner only)")
    try:
        return parse_seed(text)
    except SigningKeyError as err:
        raise SigningKeyError(f"{path}: {err}") from None


def write_seed(path: Path, key: Ed25519PrivateKey) -> bool:
    """Write ``key`` as a new seed file, readable by its owner only, unless ``path`` is there
    already: never overwrites a key. Whether it wrote it."""
    # The mode at creation, and the file moved in whole: the seed is never readable by others,
    # and a concurrent first run neither overwrites it nor reads half of it.
    return write_private(path, seed_text(key) + "\n", replace=False)


def generate_key_pair(folder: Path, name: str = "placement") -> tuple[Path, str]:
    """A new signing key as ``folder/<name>.seed`` (mode 0600) unless one is there already;
    returns the seed file and its public key text. Never overwrites a key; two first runs at
    once get the same one."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.seed"
    if not path.exists():
        write_seed(path, Ed25519PrivateKey.generate())
    return path, public_key_text(load_seed_file(path).public_key())


def _message(
    kind: Kind, node_id: str, grant_id: str, issued_at: str, kid: str, data: bytes
) -> bytes:
    # Each field length-prefixed: no choice of ids can make two different tuples sign the same.
    parts = (_DOMAIN[kind], node_id.encode(), grant_id.encode(), issued_at.encode(), kid.encode())
    head = b"".join(len(p).to_bytes(4, "big") + p for p in parts)
    return head + data


# --- batches: one signature over a hash tree of messages -------------------------------------
#
# Placement publishes grants in batches, and one ed25519 signature costs about a tenth of what
# placing a job does; so a batch is signed once, over the root of a binary hash tree whose
# leaves are its messages (as above). Each message carries its position, the batch size and
# the sibling hashes on its way to the root, so it is still verified alone; a message signed
# alone carries none and its root is its leaf. Leaves and inner nodes hash under different
# prefixes, so neither can pose as the other (as in RFC 6962); a level of odd size carries its
# last node up unchanged.
#
# The header value is hex and decimals, one header: NATS clients handle a header value per
# character, and base64's larger alphabet and extra headers cost placement more than the
# signature itself did (bench: ``grant_sign_us``, ``auth_signing_on_over_off``).

MAX_BATCH = 1 << 16
_LEAF, _NODE = b"\x00", b"\x01"


def _leaf(kind: Kind, node_id: str, grant_id: str, issued_at: str, kid: str, data: bytes) -> bytes:
    return hashlib.sha256(_LEAF + _message(kind, node_id, grant_id, issued_at, kid, data)).digest()


def _parent(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(_NODE + left + right).digest()


def _levels(leaves: list[bytes]) -> list[list[bytes]]:
    """Every level of the tree, leaves first, root last."""
    levels = [leaves]
    while len(levels[-1]) > 1:
        level = levels[-1]
        up = [_parent(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            up.append(level[-1])
        levels.append(up)
    return levels


def _proof(levels: list[list[bytes]], index: int) -> bytes:
    """The sibling hashes of leaf ``index``, bottom up."""
    out = []
    for level in levels[:-1]:
        sibling = index ^ 1
        if sibling < len(level):
            out.append(level[sibling])
        index //= 2
    return b"".join(out)


def _fold(leaf: bytes, index: int, size: int, siblings: bytes) -> bytes | None:
    """The root a proof leads to, or None when the proof doesn't fit the batch's shape."""
    node, at = leaf, 0
    while size > 1:
        if not (index == size - 1 and size % 2):  # else: carried up, no sibling at this level
            sibling = siblings[at : at + 32]
            if len(sibling) != 32:
                return None
            at += 32
            node = _parent(sibling, node) if index % 2 else _parent(node, sibling)
        index, size = index // 2, (size + 1) // 2
    return node if at == len(siblings) else None


def _root_message(issued_at: str, kid: str, root: bytes) -> bytes:
    parts = (b"gpulayer-batch-v1", issued_at.encode(), kid.encode(), root)
    return b"".join(len(p).to_bytes(4, "big") + p for p in parts)


@dataclass(frozen=True, slots=True)
class _Signed:
    """``Gpulayer-Signature``: ``KEYID.ISSUED_MS.SIGNATURE[.INDEX.SIZE.SIBLINGS]`` (hex)."""

    kid: str
    issued_at: str
    signature: bytes
    index: int = 0
    size: int = 1
    siblings: bytes = b""


_MAX_HEADER = 200 + 64 * 17  # a batch of MAX_BATCH needs 16 siblings


def _parse(text: str) -> _Signed | None:
    if len(text) > _MAX_HEADER:
        return None
    parts = text.split(".")
    if len(parts) not in (3, 6):
        return None
    try:
        sig = bytes.fromhex(parts[2])
        batch = (int(parts[3]), int(parts[4]), bytes.fromhex(parts[5])) if len(parts) == 6 else ()
    except ValueError:
        return None
    if len(sig) != 64 or len(parts[1]) > 16 or not parts[1].isdigit():
        return None
    signed = _Signed(parts[0], parts[1], sig, *batch)
    if not 0 <= signed.index < signed.size <= MAX_BATCH:
        return None
    return signed


class Signer:
    """Placement's side: the header carrying the signature of a message, or of a batch."""

    def __init__(self, key: Ed25519PrivateKey, clock: Callable[[], float] = time.time) -> None:
        self._key = key
        self._clock = clock
        self.key_id = key_id(key.public_key())
        self.public_key = public_key_text(key.public_key())

    def headers(self, kind: Kind, node_id: str, grant_id: str, data: bytes) -> dict[str, str]:
        """The header of one message signed alone."""
        return self.sign_batch(kind, [(node_id, grant_id, data)])[0]

    def sign_batch(
        self, kind: Kind, items: Sequence[tuple[str, str, bytes]]
    ) -> list[dict[str, str]]:
        """A header for each (node id, grant id, payload), all under one signature."""
        if not 0 < len(items) <= MAX_BATCH:
            raise ValueError(f"a batch holds 1 to {MAX_BATCH} messages, not {len(items)}")
        issued_at = str(int(self._clock() * 1000))
        kid = self.key_id
        levels = _levels([_leaf(kind, n, g, issued_at, kid, d) for n, g, d in items])
        sig = self._key.sign(_root_message(issued_at, kid, levels[-1][0]))
        head = f"{kid}.{issued_at}.{sig.hex()}"
        if len(items) == 1:
            return [{SIGNATURE_HEADER: head}]
        n = len(items)
        return [{SIGNATURE_HEADER: f"{head}.{i}.{n}.{_proof(levels, i).hex()}"} for i in range(n)]


class Verifier:
    """The executor's side: why a message must be refused, or None when placement signed it
    for this node, recently enough."""

    def __init__(
        self,
        keys: Iterable[Ed25519PublicKey],
        *,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        max_future_s: float = MAX_FUTURE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._keys = {key_id(k): k for k in keys}
        if not self._keys:
            raise SigningKeyError("no public key to verify with")
        self._max_age_ms = max_age_s * 1000
        self._max_future_ms = max_future_s * 1000
        self._clock = clock
        # Batch signatures already verified: the other messages of a batch cost only hashing.
        self._verified: dict[tuple[str, str, bytes, bytes], None] = {}

    def refusal(
        self,
        kind: Kind,
        node_id: str,
        grant_id: str,
        data: bytes,
        headers: Mapping[str, str] | None,
    ) -> Refusal | None:
        text = (headers or {}).get(SIGNATURE_HEADER)
        if text is None:
            return Refusal("unsigned", f"{kind} is not signed")
        # Cheap checks first: junk costs a parse, a dictionary lookup and a comparison.
        signed = _parse(text)
        if signed is None:
            return Refusal("malformed", f"{kind} signature header malformed")
        key = self._keys.get(signed.kid)
        if key is None:
            return Refusal("unknown_key", f"{kind} signed by unknown key id {signed.kid[:32]!r}")
        age_ms = self._clock() * 1000 - int(signed.issued_at)
        if age_ms > self._max_age_ms:
            return Refusal("expired", f"{kind} issued {age_ms / 1000:.0f} s ago, over the bound")
        if -age_ms > self._max_future_ms:
            return Refusal("future", f"{kind} issued {-age_ms / 1000:.0f} s in the future")
        leaf = _leaf(kind, node_id, grant_id, signed.issued_at, signed.kid, data)
        root = _fold(leaf, signed.index, signed.size, signed.siblings)
        if root is None:
            return Refusal("malformed", f"{kind} batch proof does not fit its batch")
        done = (signed.kid, signed.issued_at, signed.signature, root)
        if done in self._verified:
            return None
        try:
            key.verify(signed.signature, _root_message(signed.issued_at, signed.kid, root))
        except InvalidSignature:
            return Refusal(
                "bad_signature", f"{kind} signature does not verify for node {node_id!r}"
            )
        if len(self._verified) >= 4096:  # bounded: the oldest goes first
            del self._verified[next(iter(self._verified))]
        self._verified[done] = None
        return None


# --- settings: called from a service's __main__ only ---------------------------------------

SIGNING_SETTING = "GPULAYER_GRANT_SIGNING"
SIGNING_KEY_SETTING = "GPULAYER_PLACEMENT_SIGNING_KEY"
PUBLIC_KEYS_SETTING = "GPULAYER_PLACEMENT_PUBLIC_KEYS"
MAX_AGE_SETTING = "GPULAYER_GRANT_MAX_AGE_S"


def signing_required(env: Mapping[str, str]) -> bool:
    """Signing is on unless ``GPULAYER_GRANT_SIGNING=off`` (unsafe: any NATS client can then
    make a node run a command)."""
    raw = env.get(SIGNING_SETTING, "").strip().lower()
    if raw in ("", "on"):
        return True
    if raw == "off":
        return False
    raise ConfigError(f"{SIGNING_SETTING}={raw!r}: expected 'on' or 'off'")


def signer_from_env(env: Mapping[str, str]) -> Signer | None:
    """Placement's signer from ``GPULAYER_PLACEMENT_SIGNING_KEY``; None when signing is off."""
    if not signing_required(env):
        return None
    path = env.get(SIGNING_KEY_SETTING, "").strip()
    if not path:
        raise ConfigError(
            f"{SIGNING_KEY_SETTING} is not set: placement signs every grant with it "
            f"(`gpulayer keys generate DIR` makes one; {SIGNING_SETTING}=off disables signing, "
            "which is unsafe)"
        )
    try:
        return Signer(load_seed_file(Path(path)))
    except SigningKeyError as err:
        raise ConfigError(f"{SIGNING_KEY_SETTING}: {err}") from None


def public_keys_from_env(env: Mapping[str, str]) -> tuple[str, ...]:
    """The executor's accepted placement keys (checked here, kept as text); () when signing is
    off."""
    if not signing_required(env):
        return ()
    raw = env.get(PUBLIC_KEYS_SETTING, "").strip()
    if not raw:
        raise ConfigError(
            f"{PUBLIC_KEYS_SETTING} is not set: executors run only grants placement signed "
            f"({SIGNING_SETTING}=off disables the check, which is unsafe)"
        )
    try:
        parse_public_keys(raw)
    except SigningKeyError as err:
        raise ConfigError(f"{PUBLIC_KEYS_SETTING}: {err}") from None
    return tuple(p.strip() for p in raw.split(",") if p.strip())
