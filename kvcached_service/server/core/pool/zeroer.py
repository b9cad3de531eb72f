"""The background zeroer of one device pool.

A page a session gave back must read as zeros before anyone gets it again
(invariant 2), but the session's Free does not wait for that: the pool
hands the page here and answers. The zeroer zeroes what is waiting in
batches (at most ZERO_BATCH_MAX pages per backend call, so an Allocate
waiting for a zeroed page never waits for a huge batch), each batch one
`Backend.zero_pages` call on the zeroer's own worker thread (the CUDA
backend: one asynchronous memset per run of adjacent pages in its zeroing
windows, then one event), so zeroing never queues ahead of an Allocate's
own driver work on the device worker. A zeroed page goes back to the
pool's ready list of its last uid (`done`); a page that could not be
zeroed is never lent again (`failed` releases it).

The pool lends only ready pages: a page being zeroed is in no list, so it
cannot be lent, trimmed or released meanwhile. An Allocate that finds no
ready page but pages of its uid here waits for them (counted in
ZeroCounters.waits_total) instead of creating new ones.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from ....backends.base import Backend
from ..worker import DeviceWorker
from .books import ZeroCounters
from .pages import Page

log = logging.getLogger("kvcached.pool")

ZERO_BATCH_MAX = 256  # pages per zero_pages call


class Zeroer:
    def __init__(
        self,
        backend: Backend,
        device: int,
        worker: DeviceWorker,
        *,
        done: Callable[[list[Page]], None],
        failed: Callable[[list[Page], Exception], Awaitable[None]],
        tasks: set[asyncio.Task],
    ):
        self._backend = backend
        self._device = device
        self.worker = worker
        self._done = done
        self._failed = failed
        self._tasks = tasks
        self._queue: list[Page] = []
        self._batch: list[Page] = []
        self._by_uid: dict[int | None, int] = {}
        self._task: asyncio.Task | None = None
        self._idle: asyncio.Event | None = None
        self.counters = ZeroCounters()

    def __len__(self) -> int:
        """Pages waiting for zeroing or being zeroed."""
        return len(self._queue) + len(self._batch)

    def for_uid(self, uid: int) -> int:
        """Pages of `uid` (their last uid) waiting here."""
        return self._by_uid.get(uid, 0)

    def add(self, pages: list[Page]) -> None:
        """Zero these pages in the background (they are out of every list
        and counted as pooled by the caller)."""
        self._queue.extend(pages)
        for p in pages:
            self._by_uid[p.uid] = self._by_uid.get(p.uid, 0) + 1
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
            self._tasks.add(self._task)
            self._task.add_done_callback(self._tasks.discard)

    async def idle(self) -> None:
        """Return once nothing waits for zeroing."""
        while self._task is not None:
            await asyncio.shield(self._task)

    async def _run(self) -> None:
        try:
            while self._queue:
                batch = self._batch = self._queue[:ZERO_BATCH_MAX]
                del self._queue[:ZERO_BATCH_MAX]
                try:
                    await self.worker.call(self._backend.zero_pages, self._device, [p.handle for p in batch])
                except Exception as exc:  # a page we cannot zero must never be handed out again
                    self.counters.failures_total += len(batch)
                    self._forget(batch)
                    await self._failed(batch, exc)
                    continue
                self.counters.batches_total += 1
                self.counters.pages_total += len(batch)
                self._forget(batch)
                self._done(batch)
        finally:
            self._batch = []
            self._task = None

    def _forget(self, batch: list[Page]) -> None:
        self._batch = []
        for p in batch:
            n = self._by_uid.get(p.uid, 0) - 1
            if n > 0:
                self._by_uid[p.uid] = n
            else:
                self._by_uid.pop(p.uid, None)
