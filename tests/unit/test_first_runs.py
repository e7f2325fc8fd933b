"""First runs at once (xdist workers on a fresh machine, two `dev up`, an `auth init` beside
one): each first-run step that makes a secret makes one, and every process reads that one."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from gpulayer_runtime.auth import AuthStore
from gpulayer_runtime.signing import generate_key_pair


def _at_once(step: Callable[[], str], n: int = 8) -> set[str]:
    """What ``n`` threads released together got from ``step``."""
    got: list[str] = []
    errors: list[BaseException] = []
    start = threading.Barrier(n)

    def run() -> None:
        start.wait()
        try:
            got.append(step())
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return set(got)


def test_two_first_dev_ups_make_one_operator(tmp_path: Path) -> None:
    folder = tmp_path / "auth"

    def init() -> str:
        store = AuthStore(folder).init()
        return (folder / "operator.nk").read_text() + store.server_conf.read_text()

    operators = _at_once(init)
    assert len(operators) == 1
    # The server config names the operator whose seed is on disk: one set of keys.
    assert AuthStore(folder).exists()
    assert (folder / "server.conf").stat().st_mode & 0o777 == 0o600


def test_two_first_runs_make_one_signing_key(tmp_path: Path) -> None:
    publics = _at_once(lambda: generate_key_pair(tmp_path / "keys")[1])
    assert len(publics) == 1
    assert [p.name for p in (tmp_path / "keys").iterdir()] == ["placement.seed"]
