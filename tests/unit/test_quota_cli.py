"""``gpulayer quota``: what each form asks the API, and the API refusing non-admins."""

from __future__ import annotations

from typing import Any

import pytest
from tests.unit.placement.placement_fakes import FakePool

from gpulayer_cli.admin_cmd import _quota_body
from gpulayer_cli.main import build_parser
from gpulayer_placement.api import Api, ApiError
from gpulayer_placement.fleet import Fleet


def body(*argv: str) -> dict[str, Any]:
    return _quota_body(build_parser().parse_args(["quota", *argv]))


def test_quota_forms() -> None:
    assert body("set", "alice", "--gpus", "cuda=8", "--cores", "64", "--jobs", "100") == {
        "op": "set",
        "owner": "alice",
        "gpus": {"cuda": 8},
        "cores": 64.0,
        "jobs": 100,
    }
    assert body("set", "--default", "--gpus", "cuda=2")["owner"] is None
    assert body("delete", "alice") == {"op": "delete", "owner": "alice"}
    assert body("list") == {"op": "list"}
    with pytest.raises(SystemExit, match="not ACCELERATOR=N"):
        body("set", "alice", "--gpus", "cuda")
    with pytest.raises(SystemExit, match="name an OWNER"):
        body("set", "--gpus", "cuda=1")


async def test_only_admins_may_change_quotas_everyone_may_list_them() -> None:
    api = Api(nc=None, js=None, pool=FakePool(), fleet=Fleet(), publisher=None, forget=print)  # type: ignore[arg-type]
    for body in (b'{"op": "set", "owner": "alice", "jobs": 9}', b'{"op": "delete", "owner": "x"}'):
        with pytest.raises(ApiError, match="only admins"):
            await api.quota(body, "alice")
    assert api.pool.conn.calls == []  # type: ignore[attr-defined]
    assert await api.quota(b'{"op": "list"}', "alice") == []
    assert await api.quota(b'{"op": "list"}', "admin") == []
