"""Run a coroutine at once, on the caller's stack, until it first waits.

The fd channel serves most requests without ever waiting: a one-page
ALLOCATE from the pool, a FREE of a few pages, their REPLY into a socket
with room. Wrapping each one in an asyncio Task costs more than the request
itself (a Task object, a loop iteration, a callback). `start` runs the
coroutine right away instead; only if it has to wait (a page being created
on the device worker, a full socket, an Allocate waiting for budget) does it
become a Task, which carries on from exactly where it stopped.

On Python 3.12+ this is asyncio's own eager Task (`Task(..., eager_start=True)`):
the coroutine's first steps run inside the Task that carries it on, so
`asyncio.current_task()`, `asyncio.timeout()` and `asyncio.wait_for()` (which
3.12 builds on `timeout()`) work before the first wait, also when the caller
is a plain protocol callback with no Task of its own (the fd channel's
reader). On 3.10 and 3.11 it is done here with the coroutine protocol
itself: the Task drives a small proxy that hands the Task the very future the
coroutine is waiting on, and hands back whatever the Task sends or throws (as
`yield from` would), so cancellation and exceptions behave as in any Task.
There, until its first wait the coroutine runs in the caller's task (or
none): it must not use `asyncio.timeout()` before it (3.11's `wait_for` does
not need a task).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any, Callable, Coroutine

log = logging.getLogger("kvcached.eager")

NATIVE = sys.version_info >= (3, 12)  # asyncio.Task(..., eager_start=True)


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


def start(coro: Coroutine, tasks: set[asyncio.Task]) -> asyncio.Task | None:
    """Run `coro` now. Returns None when it finished without waiting;
    otherwise the Task that carries it on, added to `tasks` until it is done.
    An exception it raises before waiting is logged, as an unobserved Task's
    would be (callers give it coroutines that handle their own errors)."""
    loop = asyncio.get_running_loop()
    if NATIVE:
        task = asyncio.Task(coro, loop=loop, eager_start=True)
        if task.done():
            if not task.cancelled() and task.exception() is not None:
                log.error("request failed", exc_info=task.exception())
            return None
    else:
        try:
            first = coro.send(None)
        except StopIteration:
            return None
        except Exception:  # noqa: BLE001 - mirror an unobserved Task: log, do not raise into the caller
            log.exception("request failed")
            return None
        task = loop.create_task(_carry_on(_Resume(coro, first)))
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    return task
