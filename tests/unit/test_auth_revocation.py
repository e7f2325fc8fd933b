"""Revocation and expiry in the auth folder, and the ``gpulayer auth`` commands around them,
without a server (tests/integration/test_revocation.py has the servers)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gpulayer_cli.auth_cmd import parse_duration
from gpulayer_cli.common import EXIT_DENIED, EXIT_INVALID, EXIT_UNREACHABLE
from gpulayer_cli.main import main
from gpulayer_runtime.auth import (
    INDEX,
    MAX_EXPIRES_S,
    AuthError,
    AuthStore,
    decode_jwt_claims,
    public_key,
)


def _claims(creds: Path) -> dict[str, object]:
    return decode_jwt_claims(creds.read_text().splitlines()[1])


def _revocations(store: AuthStore) -> dict[str, int]:
    nats = decode_jwt_claims(store.account_jwt())["nats"]
    assert isinstance(nats, dict)
    return dict(nats.get("revocations", {}))


@pytest.fixture
def store(tmp_path: Path) -> AuthStore:
    return AuthStore(tmp_path / "auth").init()


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90m", 5400), ("12h", 43200), ("30d", 2592000), ("2w", 1209600), ("1s", 1), (" 3d ", 259200)],
)
def test_durations(text: str, seconds: int) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "text",
    ["", "30", "d", "30x", "-1d", "0d", "0s", "1.5h", "3651d", "99999999999d", "NaN", "inf",
     "1d\x00", "1d2h", "1D", "30 d", "x" * 10_000],
)  # fmt: skip
def test_bad_durations_are_refused_by_name(text: str) -> None:
    with pytest.raises(ValueError, match="--expires"):
        parse_duration(text)


@pytest.mark.parametrize("bad", [0, -1, MAX_EXPIRES_S + 1, 10**30])
def test_mint_refuses_an_expiry_out_of_bounds(store: AuthStore, bad: int) -> None:
    with pytest.raises(ValueError, match="expiry"):
        store.mint("user", "alice", expires_s=bad)
    assert not store.creds_path("user", "alice").exists()
    assert store.credentials() == []


def test_an_expiring_credential_carries_exp_and_is_listed(store: AuthStore) -> None:
    path = store.mint("node", "gpu-1", expires_s=3600)
    claims = _claims(path)
    assert claims["exp"] == claims["iat"] + 3600  # type: ignore[operator]
    (record,) = store.credentials()
    assert (record.role, record.name, record.expires) == ("node", "gpu-1", claims["exp"])
    assert record.state(time.time()) == "valid"
    assert record.state(record.expires + 1) == "expired"  # type: ignore[operator]
    # Without --expires: no exp at all (valid until revoked).
    assert "exp" not in _claims(store.mint("user", "bob"))


def test_revoke_covers_every_key_the_identity_had_and_only_it(store: AuthStore) -> None:
    first = _claims(store.mint("user", "alice"))["sub"]
    second = _claims(store.mint("user", "alice"))["sub"]  # re-minted: the first still connects
    bob = _claims(store.mint("user", "bob"))["sub"]
    node = _claims(store.mint("node", "alice"))["sub"]  # the same name in another role
    done = store.revoke("user", "alice")
    assert {c.public_key for c in done.credentials} == {first, second}
    revocations = _revocations(store)
    assert set(revocations) == {first, second}
    # At or after the credentials' issue time: the server refuses a JWT issued at or before.
    assert all(revocations[c.public_key] >= c.issued for c in done.credentials)
    assert bob not in revocations
    assert node not in revocations
    assert not store.creds_path("user", "alice").exists()
    assert store.creds_path("user", "bob").exists()
    # What the servers read: server.conf preloads the same account JWT that is pushed.
    assert done.account_jwt in store.server_conf.read_text()
    assert store.account_jwt() == done.account_jwt
    # Signed by the operator, as the server requires of an account.
    operator = public_key((store.folder / "operator.nk").read_bytes().strip())
    assert decode_jwt_claims(done.account_jwt)["iss"] == operator
    # A new credential for alice is not revoked; revoking again ends it and keeps the others.
    third = _claims(store.mint("user", "alice"))["sub"]
    assert third not in _revocations(store)
    store.revoke("user", "alice")
    assert set(_revocations(store)) == {first, second, third}


def test_revoking_what_was_never_minted_or_is_revoked_already(store: AuthStore) -> None:
    with pytest.raises(AuthError, match="no user 'carol' was minted"):
        store.revoke("user", "carol")
    store.mint("user", "carol")
    store.revoke("user", "carol")
    with pytest.raises(AuthError, match="revoked already"):
        store.revoke("user", "carol")


def test_credentials_minted_before_the_index_are_adopted(store: AuthStore) -> None:
    old = _claims(store.mint("user", "alice"))["sub"]
    (store.folder / INDEX).unlink()  # an auth folder from before this index existed
    assert [c.public_key for c in store.credentials()] == [old]
    # Re-minting must not lose it: a revoke still reaches the key that was replaced.
    store.mint("user", "alice")
    done = store.revoke("user", "alice")
    assert old in {c.public_key for c in done.credentials}


@pytest.mark.parametrize("damage", [b"", b"{", b'[{"role": 1}]', b"\x00" * 10, b"[" * 100_000])
def test_a_damaged_index_is_a_clear_error(store: AuthStore, damage: bytes) -> None:
    store.mint("user", "alice")
    (store.folder / INDEX).write_bytes(damage)
    with pytest.raises(AuthError, match=INDEX):
        store.credentials()
    with pytest.raises(AuthError, match=INDEX):
        store.revoke("user", "alice")


def test_an_older_memory_resolver_config_is_upgraded_by_init(store: AuthStore) -> None:
    store.server_conf.write_text("resolver: MEMORY\n")
    store.init()
    conf = store.server_conf.read_text()
    assert "type: full" in conf
    assert "resolver: MEMORY" not in conf
    assert store.account_jwt() in conf


def test_the_system_credential_is_short_lived_and_of_the_system_account(store: AuthStore) -> None:
    creds = store.system_creds(ttl_s=60)
    claims = decode_jwt_claims(creds.splitlines()[1])
    system = public_key((store.folder / "system.nk").read_bytes().strip())
    assert claims["iss"] == system
    assert claims["exp"] == claims["iat"] + 60
    assert not list(store.folder.rglob("*.creds"))  # never written


@pytest.mark.parametrize("key", ["operator", "system"])
def test_revoke_without_the_operator_or_system_key_is_denied_and_changes_nothing(
    store: AuthStore, capsys: pytest.CaptureFixture[str], key: str
) -> None:
    """Only who holds the auth folder's operator key may revoke: a copy of the folder without
    it (a user's, say) gets the denied status and a sentence, never a traceback."""
    store.mint("user", "alice")
    before = store.account_jwt()
    (store.folder / f"{key}.nk").unlink()
    code = main(["auth", "--dir", str(store.folder), "revoke", "user", "alice"])
    err = capsys.readouterr().err
    assert code == EXIT_DENIED
    assert f"{key}.nk is missing" in err
    assert f"{key} " in err
    assert "Traceback" not in err
    assert store.account_jwt() == before
    assert store.creds_path("user", "alice").exists()
    assert not any(c.revoked for c in store.credentials())


def test_revoke_with_no_server_up_is_kept_on_disk_and_says_so(
    store: AuthStore, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    store.mint("user", "alice")
    monkeypatch.setenv("GPULAYER_NATS_URL", "nats://127.0.0.1:1")
    code = main(["auth", "--dir", str(store.folder), "revoke", "user", "alice"])
    out, err = capsys.readouterr()
    assert code == EXIT_UNREACHABLE
    assert "revoked user alice" in out
    assert "no running server took it" in err
    assert "gpulayer auth push" in err
    assert len(_revocations(store)) == 1


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["revoke", "user", "nobody"], "no user 'nobody' was minted"),
        (["revoke", "user", "a.b"], "no user 'a.b' was minted"),
        (["revoke", "user", "a\x00b"], "no user 'a\\x00b' was minted"),
        (["revoke", "node", "x" * 5000], "no node 'xxxxxxxx"),
        (["add-user", "carol", "--expires", "30x"], "--expires '30x'"),
        (["add-user", "carol", "--expires", "0d"], "more than 0s"),
    ],
)
def test_bad_auth_commands_exit_invalid_with_a_sentence(
    store: AuthStore, capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    assert main(["auth", "--dir", str(store.folder), *argv]) == EXIT_INVALID
    err = capsys.readouterr().err
    assert says in err
    assert "Traceback" not in err
    assert not store.creds_path("user", "carol").exists()


def test_auth_list_shows_every_state(
    store: AuthStore, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    store.mint("user", "alice")
    store.mint("user", "alice")
    store.mint("node", "gpu-1", expires_s=3600)
    store.mint("user", "bob")
    store.revoke("user", "bob")
    # A minute from the credentials' expiry... an hour and a minute on: the node's expired.
    later = time.time() + 3660
    monkeypatch.setattr("gpulayer_cli.auth_cmd.time.time", lambda: later)
    assert main(["auth", "--dir", str(store.folder), "list"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "│" in line]
    by_name: dict[str, list[str]] = {}
    for row in rows:
        cells = [c.strip() for c in row.split("│")]
        by_name.setdefault(cells[2], []).append(cells[-2])
    assert sorted(by_name["alice"]) == ["valid", "valid (replaced: revoke to end it)"]
    assert by_name["gpu-1"] == ["expired"]
    assert by_name["bob"][0].startswith("revoked ")


@pytest.mark.parametrize(
    ("answers", "code", "says"),
    [
        ([("n0", True, "jwt updated")] * 3, 0, "all 3 running servers applied it"),
        ([("n0", True, "jwt updated")] * 2, 1, "1 did not answer"),
        (
            [
                ("n0", True, "jwt updated"),
                ("n1", False, "jwt update skipped"),
                ("n2", True, "jwt updated"),
            ],
            1,
            "restart it with the new one",
        ),
    ],
)
def test_what_the_servers_answered_decides_the_status(
    store: AuthStore,
    capsys: pytest.CaptureFixture[str],
    answers: list[tuple[str, bool, str]],
    code: int,
    says: str,
) -> None:
    from gpulayer_cli.auth_cmd import _report_push
    from gpulayer_runtime.account_push import Pushed, ServerAnswer

    pushed = Pushed(
        servers=3, answers=[ServerAnswer(server=s, ok=ok, message=m) for s, ok, m in answers]
    )
    assert _report_push(pushed, None, store) == code
    out, err = capsys.readouterr()
    assert says in out + err
    assert all(f"server {s}: {m}" in out for s, _, m in answers)


def test_concurrent_mints_each_land_in_the_index(store: AuthStore) -> None:
    """Two `gpulayer auth` runs at once (threads here, processes in life) share the folder's
    lock: no index entry is lost, so no key escapes a later revoke."""
    from concurrent.futures import ThreadPoolExecutor

    names = [f"u{i}" for i in range(16)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda n: store.mint("user", n), names))
    assert sorted(c.name for c in store.credentials()) == sorted(names)
    assert len({c.public_key for c in store.credentials()}) == len(names)


@pytest.mark.parametrize(
    ("raw", "ok", "says"),
    [
        (b'{"server": {"name": "n0"}, "data": {"code": 200, "message": "jwt updated"}}', True,
         "jwt updated"),
        (b'{"server": {"name": "n1"}, "data": {"message": "jwt update skipped"}}', False, "skipped"),
        (b'{"server": {"id": "NID"}, "error": {"description": "jwt validation failed"}}', False,
         "validation"),
        (b"{}", False, "no answer"),
        (b"[1, 2]", False, "unreadable"),
        (b"\x00\xff", False, "unreadable"),
        (b'{"server": {"name": 5}}', False, "unreadable"),
        (b'{"server": {"name": "' + b"n" * 100_000 + b'"}, "data": {"message": "jwt updated"}}', True, "jwt updated"),
    ],
)  # fmt: skip
def test_a_servers_answer_in_words(raw: bytes, ok: bool, says: str) -> None:
    from gpulayer_runtime.account_push import server_answer

    answer = server_answer(raw)
    assert answer.ok is ok
    assert says in answer.message
    assert len(answer.server) <= 200


def test_a_mint_and_a_revoke_are_sent_to_the_audit_trail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """What `gpulayer auth` hands the audit trail (publishing it is tests/e2e/test_limits_audit's
    part): the action, the identity, the outcome and the detail."""
    import gpulayer_cli.auth_cmd as auth_cmd

    sent: list[tuple[str, str, str, str]] = []

    def record(action: str, target: str, outcome: str = "ok", detail: str = "") -> bool:
        sent.append((action, target, outcome, detail))
        return True

    monkeypatch.setattr(auth_cmd, "record_credential_change", record)
    monkeypatch.setenv("GPULAYER_NATS_URL", "nats://127.0.0.1:1")
    folder = str(tmp_path / "auth")
    assert main(["auth", "--dir", folder, "init"]) == 0
    assert main(["auth", "--dir", folder, "add-user", "dana", "--expires", "1h"]) == 0
    assert main(["auth", "--dir", folder, "revoke", "user", "dana"]) == EXIT_UNREACHABLE
    capsys.readouterr()
    assert [(a, t, o) for a, t, o, _ in sent] == [
        ("mint", "user dana", "ok"),
        ("revoke", "user dana", "not pushed"),
    ]
    assert sent[0][3].startswith("expires ")
    assert sent[1][3].startswith("U")  # the revoked public key(s)
