"""``gpulayer_cli.common``: the one line the CLI says when NATS does not take its connection."""

from __future__ import annotations

from gpulayer_cli.common import _not_connected

URL = "nats://n1:4222"


def test_a_refusal_names_the_credential_or_asks_for_one() -> None:
    refused = Exception("nats: 'Authorization Violation'")
    assert _not_connected(URL, "/etc/alice.creds", refused) == (
        f"NATS at {URL} refused the connection: credentials /etc/alice.creds are not valid there"
    )
    assert _not_connected(URL, None, refused) == (
        f"NATS at {URL} refused the connection: it needs credentials "
        "(GPULAYER_NATS_CREDS; docs/security.md)"
    )


def test_anything_else_is_unreachable() -> None:
    assert _not_connected(URL, None, Exception("")) == (
        f"cannot reach NATS at {URL}: no server answered"
    )
    assert _not_connected(URL, None, Exception("Connect call failed")) == (
        f"cannot reach NATS at {URL}: Connect call failed"
    )
