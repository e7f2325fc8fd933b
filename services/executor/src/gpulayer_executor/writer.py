"""Group commit for the executor's grant records (``DurableWriter``)."""

from __future__ import annotations

import asyncio
import logging

from gpulayer_executor import state as st

# The executor's lines keep the logger name they had before it was split into parts.
log = logging.getLogger("gpulayer_executor.service")


class DurableWriter:
    """Group commit for the executor's records: one commit in flight at a time, and every
    write asked for meanwhile goes into the next one.

    Grants of a fetched batch are handled concurrently, and jobs start and end concurrently;
    their durable writes then share one fsync instead of queueing for one each. ``create`` and
    ``save`` return once their write is on disk. ``save_soon`` is for writes whose loss in a
    power failure is harmless (the pid of a running job, the "reported" flag): it returns at
    once and the write joins the next commit. Commits run in order, so a record's writes land
    in the order they were asked for."""

    def __init__(self, store: st.StateStore) -> None:
        self._store = store
        self._pending: list[tuple[bool, st.GrantRecord, asyncio.Future[bool] | None]] = []
        self._flusher: asyncio.Task[None] | None = None

    async def create(self, rec: st.GrantRecord) -> bool:
        """True when the record is new (the grant was not known)."""
        return await self._request(True, rec)

    async def save(self, rec: st.GrantRecord) -> None:
        await self._request(False, rec)

    def save_soon(self, rec: st.GrantRecord) -> None:
        self._pending.append((False, rec, None))
        self._wake()

    def _request(self, create: bool, rec: st.GrantRecord) -> asyncio.Future[bool]:
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._pending.append((create, rec, done))
        self._wake()
        return done

    def _wake(self) -> None:
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush_all())

    async def drain(self) -> None:
        """Until every write asked for so far is committed."""
        while self._flusher is not None and not self._flusher.done():
            await asyncio.shield(self._flusher)

    async def _flush_all(self) -> None:
        # Let the tasks made ready with this one ask for their writes first.
        await asyncio.sleep(0)
        while self._pending:
            batch, self._pending = self._pending, []
            creates = [rec for create, rec, _ in batch if create]
            saves = [rec for create, rec, _ in batch if not create]
            try:
                created = await asyncio.to_thread(self._store.write_many, creates, saves)
            except Exception as err:
                log.error("writing %d state records failed: %s", len(batch), err)
                for _, _, done in batch:
                    if done is not None and not done.done():
                        done.set_exception(err)
                continue
            first: set[str] = set()
            for create, rec, done in batch:
                new = create and rec.grant_id in created and rec.grant_id not in first
                if create:
                    first.add(rec.grant_id)
                if done is not None and not done.done():
                    done.set_result(new)
