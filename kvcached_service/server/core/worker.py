"""One thread per device for every backend call.

The CUDA context is per thread: the device's worker thread makes the primary
context current once (Backend.worker_init) and every driver call for that
device runs there. The event loop only awaits the results, so it never
blocks on the driver.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Callable

from ...backends.base import Backend


class DeviceWorker:
    def __init__(self, backend: Backend, device: int, name: str):
        self._backend = backend
        self._device = device
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kvc-{name}")
        self._thread: threading.Thread | None = None
        self._started = False

    def start(self) -> None:
        """Run worker_init on the worker thread; raises what it raised."""
        self._pool.submit(self._backend.worker_init, self._device).result()
        self._started = True

    def call_sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run on the worker thread and wait (start-up and shutdown only)."""
        return self._pool.submit(fn, *args).result()

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run on the worker thread; the event loop awaits it. The call runs
        to its end even if the awaiting task is cancelled (a release or a
        zeroing must not be dropped from the queue half-way)."""
        return await asyncio.shield(asyncio.wrap_future(self._pool.submit(fn, *args)))

    def stop(self) -> None:
        if self._started:
            try:
                self._pool.submit(self._backend.worker_exit, self._device).result()
            finally:
                self._started = False
        self._pool.shutdown(wait=True)
