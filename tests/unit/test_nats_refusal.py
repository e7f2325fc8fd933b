"""A credential the server refuses is named as such in the services' NATS log lines."""

from __future__ import annotations

import nats.errors
import pytest

from gpulayer_runtime.nats import refusal_note


@pytest.mark.parametrize(
    "err",
    [
        nats.errors.AuthorizationError(),  # nats-py: "authorization failed"
        nats.errors.Error("nats: 'Authorization Violation'"),
        nats.errors.Error("nats: 'User Authentication Revoked'"),
        nats.errors.Error("nats: 'User Authentication Expired'"),
    ],
)
def test_a_refusal_names_the_credential(err: Exception) -> None:
    note = refusal_note(err, "/etc/gpulayer/node.creds")
    assert "refused the credential /etc/gpulayer/node.creds" in note
    assert "revoked, expired" in note


def test_no_credential_is_said() -> None:
    assert "no credential given" in refusal_note(nats.errors.AuthorizationError(), None)


@pytest.mark.parametrize(
    "err",
    [
        None,
        nats.errors.UnexpectedEOF(),
        nats.errors.ConnectionClosedError(),
        nats.errors.Error("nats: 'Permissions Violation for Publish to \"x\"'"),
        OSError("[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed"),
    ],
)
def test_other_errors_get_no_note(err: Exception | None) -> None:
    assert refusal_note(err, "/etc/gpulayer/node.creds") == ""
