"""Signing and verifying grants and cancels (pure): what verifies, and each way a message is
refused, with the reason the executor counts it under."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gpulayer_runtime.settings import ConfigError
from gpulayer_runtime.signing import (
    SIGNATURE_HEADER,
    Signer,
    SigningKeyError,
    Verifier,
    generate_key_pair,
    load_seed_file,
    parse_public_keys,
    parse_seed,
    public_keys_from_env,
    signer_from_env,
    signing_required,
)

NOW = 1_700_000_000.0
KEY = Ed25519PrivateKey.generate()
SIGNER = Signer(KEY, clock=lambda: NOW)
DATA = b'{"grant_id":"g-1","node_id":"node-a","job":{"job_id":"j"}}'


def verifier(*signers: Signer, max_age_s: float = 3600.0, now: float = NOW) -> Verifier:
    keys = parse_public_keys(",".join(s.public_key for s in signers or (SIGNER,)))
    return Verifier(keys, max_age_s=max_age_s, clock=lambda: now)


def reason(v: Verifier, headers: dict[str, str] | None, **over: str | bytes) -> str | None:
    kind = str(over.get("kind", "grant"))
    assert kind in ("grant", "cancel")
    data = over.get("data", DATA)
    assert isinstance(data, bytes)
    refusal = v.refusal(
        kind,  # type: ignore[arg-type]
        str(over.get("node", "node-a")),
        str(over.get("grant_id", "g-1")),
        data,
        headers,
    )
    return None if refusal is None else refusal.reason


def test_a_signed_grant_verifies_for_its_node_grant_and_kind() -> None:
    h = SIGNER.headers("grant", "node-a", "g-1", DATA)
    kid, issued_at, sig = h[SIGNATURE_HEADER].split(".")
    assert (kid, issued_at, len(bytes.fromhex(sig))) == (SIGNER.key_id, str(int(NOW * 1000)), 64)
    assert reason(verifier(), h) is None


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"node": "node-b"}, "bad_signature"),  # moved to another node's subject
        ({"grant_id": "g-2"}, "bad_signature"),  # bound to another grant
        ({"kind": "cancel"}, "bad_signature"),  # a grant's signature on a cancel
        ({"data": DATA.replace(b'"j"', b'"k"')}, "bad_signature"),  # bytes tampered
        ({"data": DATA + b" "}, "bad_signature"),
    ],
)
def test_a_signature_does_not_move(change: dict[str, str | bytes], expected: str) -> None:
    h = SIGNER.headers("grant", "node-a", "g-1", DATA)
    assert reason(verifier(), h, **change) == expected


def test_unsigned_forged_and_malformed_are_refused_by_reason() -> None:
    v = verifier()
    assert reason(v, None) == "unsigned"
    assert reason(v, {"traceparent": "x"}) == "unsigned"
    good = SIGNER.headers("grant", "node-a", "g-1", DATA)
    # Another key, unknown to the executor.
    other = Signer(Ed25519PrivateKey.generate(), clock=lambda: NOW)
    assert reason(v, other.headers("grant", "node-a", "g-1", DATA)) == "unknown_key"
    # Another key claiming to be placement's key id.
    kid, issued_at, sig = other.headers("grant", "node-a", "g-1", DATA)[SIGNATURE_HEADER].split(".")
    forged = {SIGNATURE_HEADER: f"{SIGNER.key_id}.{issued_at}.{sig}"}
    assert reason(v, forged) == "bad_signature"
    # Junk in the header.
    kid, issued_at, sig = good[SIGNATURE_HEADER].split(".")
    for junk in (
        "",
        "x",
        f"{kid}.{issued_at}",
        f"{kid}.soon.{sig}",
        f"{kid}.{'9' * 400}.{sig}",
        f"{kid}.{issued_at}.{sig[:-2]}",
        f"{kid}.{issued_at}.{'zz' * 64}",
        f"{kid}.{issued_at}.{sig}.0.1",
        f"{kid}.{issued_at}.{sig}." + "a" * 5000,
    ):
        assert reason(v, {SIGNATURE_HEADER: junk}) == "malformed", junk
    assert reason(v, {SIGNATURE_HEADER: f"{kid}.{issued_at}.{'00' * 64}"}) == "bad_signature"
    # The issued-at time is signed: moving it breaks the signature.
    later = str(int(NOW * 1000) + 1)
    assert reason(v, {SIGNATURE_HEADER: f"{kid}.{later}.{sig}"}) == "bad_signature"


def test_an_old_grant_is_expired_and_one_from_the_far_future_refused() -> None:
    h = SIGNER.headers("grant", "node-a", "g-1", DATA)
    assert reason(verifier(max_age_s=60, now=NOW + 59), h) is None
    assert reason(verifier(max_age_s=60, now=NOW + 61), h) == "expired"
    # A little clock skew is fine; far ahead would stretch the replay window.
    assert reason(verifier(now=NOW - 10), h) is None
    assert reason(verifier(now=NOW - 3600), h) == "future"


def batch(n: int) -> list[tuple[str, str, bytes]]:
    return [(f"node-{i % 3}", f"g-{i}", DATA.replace(b"g-1", f"g-{i}".encode())) for i in range(n)]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 8, 9, 64, 100])
def test_each_message_of_a_signed_batch_verifies_alone(n: int) -> None:
    items = batch(n)
    signed = SIGNER.sign_batch("grant", items)
    assert len({h[SIGNATURE_HEADER].split(".")[2] for h in signed}) == 1  # one signature
    assert len(signed[0][SIGNATURE_HEADER].split(".")) == (6 if n > 1 else 3)
    shared = verifier()
    for (node, grant_id, data), h in zip(items, signed, strict=True):
        # A fresh verifier each time too: no cached root may hide a bad proof.
        assert reason(verifier(), h, node=node, grant_id=grant_id, data=data) is None
        assert reason(shared, h, node=node, grant_id=grant_id, data=data) is None
        assert reason(shared, h, node=node, grant_id=grant_id, data=data + b" ") == (
            "bad_signature"
        )
        assert reason(shared, h, node="node-x", grant_id=grant_id, data=data) == "bad_signature"


def test_a_batch_proof_does_not_move_to_another_message() -> None:
    items = batch(5)
    signed = SIGNER.sign_batch("grant", items)
    v = verifier()
    node, grant_id, data = items[1]
    assert reason(v, signed[1], node=node, grant_id=grant_id, data=data) is None  # cached now
    for other in (0, 2, 4):
        assert reason(v, signed[other], node=node, grant_id=grant_id, data=data) in (
            "bad_signature",
            "malformed",
        )
    # Junk proofs are malformed, not a crash.
    kid, issued_at, sig, index, size, hashes = signed[1][SIGNATURE_HEADER].split(".")
    head = f"{kid}.{issued_at}.{sig}"
    for junk in (
        f"{index}.{size}.{hashes}.1",
        f"{index}.{size}.x",
        f"5.5.{hashes}",
        f"-1.5.{hashes}",
        f"0.70000.{hashes}",
        f"{index}.{size}.{hashes[:-64]}",  # missing a sibling
        f"{index}.{size}.{hashes}{'00' * 32}",  # one too many
        f"{index}.{size}.{hashes}0",
    ):
        h = {SIGNATURE_HEADER: f"{head}.{junk}"}
        assert reason(v, h, node=node, grant_id=grant_id, data=data) == "malformed", junk


def test_a_verified_batch_is_still_checked_for_age() -> None:
    items = batch(4)
    signed = SIGNER.sign_batch("grant", items)
    now = [NOW]
    v = Verifier(parse_public_keys(SIGNER.public_key), max_age_s=60, clock=lambda: now[0])
    node, grant_id, data = items[0]
    assert reason(v, signed[0], node=node, grant_id=grant_id, data=data) is None
    now[0] = NOW + 61
    assert reason(v, signed[0], node=node, grant_id=grant_id, data=data) == "expired"


def test_several_keys_allow_rotation() -> None:
    new = Signer(Ed25519PrivateKey.generate(), clock=lambda: NOW)
    v = verifier(SIGNER, new)
    assert reason(v, SIGNER.headers("grant", "node-a", "g-1", DATA)) is None
    assert reason(v, new.headers("grant", "node-a", "g-1", DATA)) is None


def test_public_keys_parse_and_bad_ones_are_named() -> None:
    assert len(parse_public_keys(f" {SIGNER.public_key} ,, ")) == 1
    with pytest.raises(SigningKeyError, match="expected 32"):
        parse_public_keys("abcd")
    with pytest.raises(SigningKeyError, match="not base64url"):
        parse_public_keys("a")
    with pytest.raises(SigningKeyError, match="no public key"):
        Verifier([])


def test_key_files(tmp_path: Path) -> None:
    seed, public = generate_key_pair(tmp_path / "keys")
    assert stat.S_IMODE(seed.stat().st_mode) == 0o600
    again, same = generate_key_pair(tmp_path / "keys")  # kept, not replaced
    assert (again, same) == (seed, public)
    assert Signer(load_seed_file(seed)).public_key == public
    seed.chmod(0o644)
    with pytest.raises(SigningKeyError, match="must be 0600"):
        load_seed_file(seed)
    with pytest.raises(SigningKeyError, match="No such file"):
        load_seed_file(tmp_path / "missing")
    # openssl's PEM works too; a PEM of another key type is named.
    pem = KEY.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    assert Signer(parse_seed(pem)).public_key == SIGNER.public_key
    with pytest.raises(SigningKeyError, match="expected 32"):
        parse_seed("abcd")


def test_settings(tmp_path: Path) -> None:
    seed, public = generate_key_pair(tmp_path)
    assert signing_required({})
    assert not signing_required({"GPULAYER_GRANT_SIGNING": "off"})
    with pytest.raises(ConfigError, match="GPULAYER_GRANT_SIGNING"):
        signing_required({"GPULAYER_GRANT_SIGNING": "maybe"})
    # Secure by default: nothing configured is an error naming the setting, not a silent "off".
    with pytest.raises(ConfigError, match="GPULAYER_PLACEMENT_SIGNING_KEY is not set"):
        signer_from_env({})
    with pytest.raises(ConfigError, match="GPULAYER_PLACEMENT_PUBLIC_KEYS is not set"):
        public_keys_from_env({})
    assert signer_from_env({"GPULAYER_GRANT_SIGNING": "off"}) is None
    assert public_keys_from_env({"GPULAYER_GRANT_SIGNING": "off"}) == ()
    signer = signer_from_env({"GPULAYER_PLACEMENT_SIGNING_KEY": str(seed)})
    assert signer is not None
    assert signer.public_key == public
    keys = public_keys_from_env(
        {"GPULAYER_PLACEMENT_PUBLIC_KEYS": f"{public}, {SIGNER.public_key}"}
    )
    assert keys == (public, SIGNER.public_key)
    with pytest.raises(ConfigError, match="GPULAYER_PLACEMENT_PUBLIC_KEYS: public key 'x"):
        public_keys_from_env({"GPULAYER_PLACEMENT_PUBLIC_KEYS": "xyz"})
    os.chmod(seed, 0o640)
    with pytest.raises(ConfigError, match=r"GPULAYER_PLACEMENT_SIGNING_KEY: .*0640"):
        signer_from_env({"GPULAYER_PLACEMENT_SIGNING_KEY": str(seed)})


def test_keys_generate_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gpulayer_cli.main import main

    assert main(["keys", "generate", str(tmp_path / "k")]) == 0
    lines = dict(line.split("=", 1) for line in capsys.readouterr().out.splitlines() if "=" in line)
    seed = Path(lines["GPULAYER_PLACEMENT_SIGNING_KEY"])
    assert seed == (tmp_path / "k" / "placement.seed").resolve()
    assert stat.S_IMODE(seed.stat().st_mode) == 0o600
    # The printed public key is the seed's: what the executors need to accept its grants.
    signer = signer_from_env(lines)
    assert signer is not None
    assert public_keys_from_env(lines) == (signer.public_key,)
    # Run again: the key is kept, the same settings printed.
    assert main(["keys", "generate", str(tmp_path / "k")]) == 0
    assert lines["GPULAYER_PLACEMENT_PUBLIC_KEYS"] in capsys.readouterr().out


def test_placement_signs_the_grant_and_cancel_bytes_it_publishes() -> None:
    from typing import Any, cast

    from gpulayer_contracts import CancelJob, Grant, JobRequest
    from gpulayer_contracts.subjects import MSG_ID_HEADER, node_control, node_grants
    from gpulayer_placement.publisher import Publisher
    from gpulayer_placement.settings import Settings

    grant = Grant(
        grant_id="j-1",
        job=JobRequest(job_id="j", command=["true"]),
        node_id="node-a",
        accelerator="cpu",
    )
    subject, data, headers = Publisher.grant_item(grant, {"traceparent": "t"}, SIGNER)
    assert subject == node_grants("node-a")
    assert (headers[MSG_ID_HEADER], headers["traceparent"]) == ("j-1", "t")
    assert reason(verifier(), headers, data=data, grant_id="j-1") is None
    # Without a signer (signing off) nothing is added, and an executor that checks refuses it.
    _, data, headers = Publisher.grant_item(grant)
    assert SIGNATURE_HEADER not in headers
    assert reason(verifier(), headers, data=data, grant_id="j-1") == "unsigned"

    publisher = Publisher(cast(Any, None), cast(Any, None), Settings(), signer=SIGNER)
    cancel = CancelJob(job_id="j", reason="user asked", grant_id="j-1")
    subject, data, headers = publisher.cancel_item("node-a", cancel)
    assert subject == node_control("node-a")
    assert headers[MSG_ID_HEADER] == "cancel:j-1"
    assert reason(verifier(), headers, kind="cancel", data=data, grant_id="j-1") is None
    # Bound to the grant it cancels: useless against another grant of the same job.
    assert reason(verifier(), headers, kind="cancel", data=data, grant_id="j-2") == "bad_signature"


def test_placement_signs_a_batch_of_grants_once_each_verifiable_by_its_node() -> None:
    from typing import Any, cast

    from gpulayer_contracts import Grant, JobRequest
    from gpulayer_contracts.subjects import node_grants
    from gpulayer_placement.publisher import Publisher
    from gpulayer_placement.settings import Settings

    grants = [
        Grant(
            grant_id=f"j{i}-1",
            job=JobRequest(job_id=f"j{i}", command=["true"]),
            node_id=f"node-{i % 3}",
            accelerator="cpu",
        )
        for i in range(7)
    ]
    publisher = Publisher(cast(Any, None), cast(Any, None), Settings(), signer=SIGNER)
    items = publisher.grant_items(grants, [{"traceparent": f"t{i}"} for i in range(7)])
    assert len({h[SIGNATURE_HEADER].split(".")[2] for _, _, h in items}) == 1
    for grant, (subject, data, headers) in zip(grants, items, strict=True):
        assert subject == node_grants(grant.node_id)
        assert headers["traceparent"] == f"t{grants.index(grant)}"
        assert (
            reason(verifier(), headers, node=grant.node_id, grant_id=grant.grant_id, data=data)
            is None
        )
        other = "node-9"
        assert reason(verifier(), headers, node=other, grant_id=grant.grant_id, data=data) == (
            "bad_signature"
        )
