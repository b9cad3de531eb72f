"""Run a coroutine at once, on the caller's stack, until it first waits.

The fd channel serves most requests without ever waiting: a one-page
ALLOCATE from the pool, a FREE of a few pages, their REPLY into a socket
with room. Wrapping each one in an asyncio Task costs more than the request
itself (a Task object, a loop iteration, a callback). `start` runs the
coroutine right away instead; only if it has to wait (a page being created
on the device worker, a full socket, an Allocate waiting for budget) does it
become a Task, which carries on from exactly where it stopped.

This is what Python 3.12's `asyncio.eager_task_factory` does; the daemon
runs on 3.10+, so it is done here with the coroutine protocol itself: the
Task drives a small proxy that hands the Task the very future the coroutine
is waiting on, and hands back whatever the Task sends or throws (as
`yield from` would), so cancellation and exceptions behave as in any Task.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Coroutine

log = logging.getLogger("kvcached.eager")


class _Resume:
    """An awaitable that continues a coroutine already started."""

    __slots__ = ("_coro", "_first")

    def __init__(self, coro: Coroutine, first: Any):
        self._coro = coro
        self._first = first

    def __await__(self):
        coro, yielded = self._coro, self._first
        self._first = None
        while True:
            try:
                sent = yield yielded
            except BaseException as exc:  # noqa: BLE001 - thrown in by the Task (cancel): pass it on
                try:
                    yielded = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    yielded = coro.send(sent)
                except StopIteration as stop:
                    return stop.value


async def _carry_on(resume: _Resume) -> Any:
    return await resume


def start(coro: Coroutine, spawn: Callable[[Coroutine], asyncio.Task]) -> asyncio.Task | None:
    """Run `coro` now. Returns None when it finished without waiting;
    otherwise the Task (made by `spawn`) that carries it on. An exception
    it raises before waiting is logged, as an unobserved Task's would be
    (callers give it coroutines that handle their own errors)."""
    try:
        first = coro.send(None)
    except StopIteration:
        return None
    except Exception:  # noqa: BLE001 - mirror an unobserved Task: log, do not raise into the caller
        log.exception("request failed")
        return None
    return spawn(_carry_on(_Resume(coro, first)))
