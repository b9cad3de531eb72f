"""Elastic sharing: who gives pages back when memory is short.

The daemon cannot take pages by force: a client has them mapped. It *asks*
through the session's Watch stream (a RECLAIM event: device, pages, deadline)
and the client answers with Free. This module decides whom to ask, how much,
and remembers the asks so that

  * two waiting Allocates do not ask the same pages twice,
  * a session that lets an ask expire is counted (reclaim_ignored), logged,
    and asked first next time,
  * idle sessions are asked to shrink to their guarantee.

Victim policy (docs/elasticity.md has a worked example):
  1. never below a session's guarantee: only held - guaranteed is reclaimable;
  2. a requester asks sessions of its own priority or lower, unless it is
     below its own guarantee (then anyone above theirs may be asked);
  3. order: sessions that ignored an ask before first, then lower priority
     first, then least recently active first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .pool import DevicePool
    from .sessions import Session

log = logging.getLogger("kvcached.elastic")


@dataclass
class Ask:
    """An open request to `session`: hold at most `keep` pages on a device by
    `deadline` (wall clock)."""

    keep: int
    deadline: float
    reason: str


def guaranteed_pages(s: "Session", pool: "DevicePool") -> int:
    return -(-s.guaranteed_bytes // pool.page_size)


def pending_pages(s: "Session", pool: "DevicePool", now: float) -> int:
    ask = s.asks.get(pool.uuid)
    if ask is None or ask.deadline < now:
        return 0
    return max(0, s.held_pages(pool.uuid) - ask.keep)


def reclaimable(s: "Session", pool: "DevicePool", now: float) -> int:
    """Pages we could still ask `s` for (not already asked)."""
    return max(0, s.held_pages(pool.uuid) - guaranteed_pages(s, pool) - pending_pages(s, pool, now))


class Reclaimer:
    def __init__(self, sessions: Callable[[], list["Session"]], post: Callable[["Session", str, dict], None], reclaim_timeout: float):
        self._sessions = sessions
        self._post = post
        self.reclaim_timeout = reclaim_timeout
        self.requests_total = 0
        self.requests_by_reason: dict[str, int] = {}
        self.ignored_total = 0
        self.pages_asked_total = 0
        self.pages_returned_total = 0  # pages freed while a request for them was open

    def victims(self, pool: "DevicePool", requester: "Session", now: float) -> list["Session"]:
        below_guarantee = requester.held_pages(pool.uuid) < guaranteed_pages(requester, pool)
        out = [
            s
            for s in self._sessions()
            if s is not requester
            and not s.closed
            and reclaimable(s, pool, now) > 0
            and (below_guarantee or s.priority <= requester.priority)
        ]
        out.sort(key=lambda s: (-min(s.reclaim_ignored, 1), s.priority, s.last_active))
        return out

    def request(self, pool: "DevicePool", requester: "Session", missing: int, deadline: float) -> list[tuple["Session", int]]:
        """Ask other sessions for `missing` pages by `deadline`, counting
        pages already asked for. Returns [(session, pages)] newly asked."""
        now = time.time()
        outstanding = sum(pending_pages(s, pool, now) for s in self._sessions() if s is not requester)
        need = missing - outstanding
        asked: list[tuple["Session", int]] = []
        if need <= 0:
            return asked
        for s in self.victims(pool, requester, now):
            take = min(reclaimable(s, pool, now), need)
            self.ask(s, pool, take, deadline, "allocate")
            asked.append((s, take))
            need -= take
            if need <= 0:
                break
        return asked

    def ask(self, s: "Session", pool: "DevicePool", pages: int, deadline: float, reason: str) -> None:
        """Ask `s` to give back `pages` more pages of `pool` by `deadline`."""
        now = time.time()
        held = s.held_pages(pool.uuid)
        keep = max(guaranteed_pages(s, pool), held - pending_pages(s, pool, now) - pages)
        cur = s.asks.get(pool.uuid)
        if cur is not None and cur.deadline >= now:
            keep = min(keep, cur.keep)
            deadline = max(deadline, cur.deadline)
        ask = Ask(keep, deadline, reason)
        s.asks[pool.uuid] = ask
        s.reclaim_requests += 1
        self.requests_total += 1
        self.requests_by_reason[reason] = self.requests_by_reason.get(reason, 0) + 1
        self.pages_asked_total += held - keep
        self._post(s, "RECLAIM", {"device": pool.uuid, "pages": held - keep, "deadline_unix": deadline, "reason": reason})
        log.info("asked session %d '%s' to give back %d pages of %s by %.2fs from now (%s)",
                 s.id, s.name, held - keep, pool.uuid, deadline - now, reason)
        loop = asyncio.get_running_loop()
        loop.call_later(max(0.0, deadline - now), self._expire, s, pool.uuid, ask)

    def _expire(self, s: "Session", uuid: str, ask: Ask) -> None:
        if s.asks.get(uuid) is not ask:
            return  # superseded by a later ask, which checks itself
        del s.asks[uuid]
        if not s.closed and s.held_pages(uuid) > ask.keep:
            s.reclaim_ignored += 1
            self.ignored_total += 1
            log.warning(
                "session %d '%s' (pid %d) ignored a reclaim request: holds %d pages on %s, was asked to keep %d",
                s.id, s.name, s.pid, s.held_pages(uuid), uuid, ask.keep,
            )

    def settle(self, s: "Session", uuid: str, freed: int) -> None:
        """After a Free of `freed` pages: count what answered an open ask;
        an ask the session has met is done."""
        ask = s.asks.get(uuid)
        if ask is None:
            return
        held = s.held_pages(uuid)
        self.pages_returned_total += min(freed, max(0, held + freed - ask.keep))
        if held <= ask.keep:
            del s.asks[uuid]

    def idle_scan(self, pools: list["DevicePool"], idle_seconds: float) -> None:
        """Ask sessions idle for idle_seconds to shrink to their guarantee
        (once per idle period)."""
        if idle_seconds <= 0:
            return
        mono = time.monotonic()
        now = time.time()
        for s in self._sessions():
            if s.closed or s.idle_asked or mono - s.last_active < idle_seconds:
                continue
            s.idle_asked = True
            for pool in pools:
                extra = reclaimable(s, pool, now)
                if extra > 0:
                    self.ask(s, pool, extra, now + self.reclaim_timeout, "idle")
