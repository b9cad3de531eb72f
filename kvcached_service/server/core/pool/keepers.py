"""Who keeps an imported handle of which pooled page, and the DROP asks.

A client that frees pages with the FREE record's keep flag keeps the
handles it imported (docs/protocol.md, "Kept handles"): when a page comes
back to it, it maps the kept handle instead of importing the page again.
A kept handle keeps the page's memory alive, so the pool must not release
such a page (to make room for another uid, to trim the idle pool, after a
failed zeroing) until every keeper let its handle go: `release_ready` asks
each keeper with DROP and waits for its DROPPED, or for its session to end.
A keeper that stays silent for `timeout` seconds (fd_send_timeout) loses
its session (`silent`), which ends its keeps.

Keeping changes nobody's right to a page: who may be lent a pooled page is
still ReadyPages' question (its last uid, invariant 2).

Owned state: each Page's `keepers` set, and per session the pages it
keeps. Touched only on the event loop thread.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from .pages import Page

if TYPE_CHECKING:
    from ..sessions import Session

log = logging.getLogger("kvcached.pool")


@dataclass
class KeepCounters:
    """What keeping cost (read by metrics)."""

    drops_total: int = 0  # DROP records' pages asked for
    dropped_total: int = 0  # pages a keeper said it let go (DROPPED)
    silent_total: int = 0  # keepers that lost their session for not answering DROP
    drop_wait_seconds_total: float = 0.0  # time releases waited for DROPPED


class Keepers:
    def __init__(self, device: str, *, ask: Callable[["Session", list[int]], None] | None = None,
                 silent: Callable[["Session", int], None] | None = None, timeout: float = 5.0):
        self.device = device
        self.ask = ask  # sends a DROP of these page ids to the session's client
        self.silent = silent  # ends a session that did not answer (session, pages asked)
        self.timeout = timeout
        self._by_session: dict["Session", dict[int, Page]] = {}
        self._kept = 0  # pages with at least one keeper (GetStats and metrics read it: no walk over every keep)
        self._changed: asyncio.Event | None = None
        self.counters = KeepCounters()

    def __len__(self) -> int:
        """Pages with at least one keeper."""
        return self._kept

    def keeps(self, session: "Session") -> int:
        """Pages `session` keeps a handle of."""
        return len(self._by_session.get(session, ()))

    def keep(self, session: "Session", pages: list[Page]) -> None:
        """`session` freed `pages` with keep: it is their keeper until it
        says DROPPED or ends."""
        mine = self._by_session.setdefault(session, {})
        for p in pages:
            if p.keepers is None:
                p.keepers = set()
            if not p.keepers:
                self._kept += 1
            p.keepers.add(session)
            mine[p.id] = p

    def dropped(self, session: "Session", page_ids) -> int:
        """DROPPED from `session`: returns how many of `page_ids` it kept."""
        mine = self._by_session.get(session)
        if not mine:
            return 0
        n = 0
        for pid in page_ids:
            p = mine.pop(pid, None)
            if p is not None:
                self._unkeep(p, session)
                n += 1
        if not mine:
            del self._by_session[session]
        self.counters.dropped_total += n
        if n:
            self._wake()
        return n

    def forget(self, session: "Session") -> None:
        """`session` ended: it keeps nothing any more."""
        mine = self._by_session.pop(session, None)
        if mine:
            for p in mine.values():
                self._unkeep(p, session)
            self._wake()

    def _unkeep(self, p: Page, session: "Session") -> None:
        p.keepers.discard(session)  # type: ignore[union-attr]
        if not p.keepers:
            self._kept -= 1

    async def release_ready(self, pages: list[Page]) -> None:
        """Return once no page of `pages` has a keeper: each keeper is sent
        one DROP of its pages among them and answers DROPPED (or its session
        ends); a keeper silent for `timeout` s loses its session."""
        kept = [p for p in pages if p.keepers]
        if not kept:
            return
        asked: dict["Session", list[int]] = {}
        for p in kept:
            for s in p.keepers:  # type: ignore[union-attr]
                asked.setdefault(s, []).append(p.id)
        loop = asyncio.get_running_loop()
        start = loop.time()
        for s, ids in asked.items():
            self.counters.drops_total += len(ids)
            if self.ask is not None:
                self.ask(s, ids)
        try:
            while True:
                waiting = {s for p in kept for s in p.keepers}  # type: ignore[union-attr]
                if not waiting:
                    return
                left = start + self.timeout - loop.time()
                if left <= 0:
                    for s in waiting:
                        n = len(asked.get(s, ()))
                        log.warning("device %s: session %d did not answer DROP of %d pages within %g s; ending it",
                                    self.device, s.id, n, self.timeout)
                        self.counters.silent_total += 1
                        if self.silent is not None:
                            self.silent(s, n)
                        self.forget(s)  # ended or not, its keeps end here: the page is released
                    return
                ev = self._changed
                if ev is None:
                    ev = self._changed = asyncio.Event()
                try:
                    await asyncio.wait_for(ev.wait(), left)
                except asyncio.TimeoutError:
                    pass
        finally:
            self.counters.drop_wait_seconds_total += loop.time() - start

    def _wake(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None
