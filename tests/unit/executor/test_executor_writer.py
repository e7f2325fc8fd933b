"""The group commit alone, over a real state store in a temp folder."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Sequence
from pathlib import Path

import pytest
from tests.unit.executor.fakes import grant

from gpulayer_executor import state as st
from gpulayer_executor.writer import DurableWriter


async def test_durable_writes_made_together_share_a_commit_and_each_get_their_answer(
    tmp_path: Path,
) -> None:
    store = st.StateStore(tmp_path)
    known = st.received(grant("known", "j0"))
    store.create(known)
    writer = DurableWriter(store)
    commits: list[tuple[int, int]] = []
    write_many = store.write_many

    def counting(creates: Sequence[st.GrantRecord], saves: Sequence[st.GrantRecord]) -> set[str]:
        commits.append((len(creates), len(saves)))
        return write_many(creates, saves)

    store.write_many = counting  # type: ignore[method-assign]
    a, b = st.received(grant("a", "ja")), st.received(grant("b", "jb"))
    results = await asyncio.gather(
        writer.create(a),
        writer.create(b),
        writer.create(st.received(grant("a", "ja"))),  # a copy in the same batch
        writer.create(st.received(grant("known", "j0"))),
        writer.save(st.starting(known)),
    )
    assert list(results) == [True, True, False, False, None]
    assert commits == [(4, 1)]
    assert store.load("known") == st.starting(known)
    store.close()
    with pytest.raises(sqlite3.ProgrammingError):
        await writer.create(st.received(grant("c", "jc")))


async def test_writes_not_waited_for_land_in_the_order_asked(tmp_path: Path) -> None:
    store = st.StateStore(tmp_path)
    writer = DurableWriter(store)
    rec = st.received(grant("g1"))
    assert await writer.create(rec)
    started = st.starting(rec)
    running = st.running(started, st.ProcessInfo(pid=5, pgid=5))
    writer.save_soon(started)
    writer.save_soon(running)
    assert store.load("g1") == rec  # nothing waited for yet
    await writer.drain()
    assert store.load("g1") == running
