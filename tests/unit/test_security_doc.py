"""docs/security.md shows every subject each role's credential allows, as
``gpulayer_runtime.roles.permissions`` computes them (for a node ``gpu-01`` and a user
``alice``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpulayer_runtime.roles import Role, permissions

DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"


@pytest.mark.parametrize(
    ("role", "name"), [("placement", ""), ("node", "gpu-01"), ("user", "alice"), ("viewer", "web")]
)
def test_security_doc_lists_each_roles_permissions(role: Role, name: str) -> None:
    text = DOC.read_text()
    perms = permissions(role, name)
    stream_api = ("$JS.API.STREAM.INFO.", "$JS.API.STREAM.CREATE.", "$JS.API.STREAM.UPDATE.")
    for subject in (*perms.publish, *perms.subscribe):
        if role == "placement" and subject.startswith(stream_api):
            # Shown once as a pattern over every stream.
            prefix = subject.rsplit(".", 1)[0]
            assert f"`{prefix}.<stream>`" in text, subject
            continue
        assert f"`{subject}`" in text, f"docs/security.md: {role} may use {subject}, not listed"


def test_admins_have_everything() -> None:
    perms = permissions("admin", "ops")
    assert perms.publish == (">",)
    assert perms.subscribe == (">",)
