"""Elastic sharing: who gives pages back when memory is short.

The daemon cannot take pages by force: a client has them mapped. It *asks*
through the session's Watch stream (a RECLAIM event: id, device, pages,
deadline) and the client answers with Free, and may say at once what it gave
and what it keeps (an ANSWER record on its fd channel naming the event's id:
docs/protocol.md, "The reclaim answer"). This module decides whom to ask,
how much, and remembers the asks so that

  * two waiting Allocates do not ask the same pages twice,
  * a session that lets an ask expire without answering is counted
    (reclaim_ignored), logged, and asked first next time,
  * a session that answered keeps what it said it keeps until the ask's
    deadline: nobody waits for those pages, nobody asks it again meanwhile,
  * idle sessions are asked to shrink to their guarantee,
  * RequestShrink can wait for the outcome of its asks (`Reclaim.settled`).

Victim policy (docs/elasticity.md has a worked example):
  1. never below a session's guarantee: only held - guaranteed is reclaimable;
  2. a requester asks sessions of its own priority or lower, unless it is
     below its own guarantee (then anyone above theirs may be asked);
  3. order: sessions that ignored an ask before first, then sessions keeping
     standby pages (mapped, not in use: docs/protocol.md, "Standby pages"),
     then lower priority first, then least recently active first.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from ... import errors

if TYPE_CHECKING:
    from .pool import DevicePool
    from .sessions import Session

log = logging.getLogger("kvcached.elastic")

# No session can answer an ask in less than this: a waiter whose deadline is
# nearer asks nobody (an ask due at once would only expire at once and count
# its session as ignoring a request it never had time for).
MIN_ASK_S = 0.02


@dataclass(eq=False)
class Reclaim:
    """One RECLAIM event sent to a session, and how it ended: `state` is
    open, then met (the session holds at most `keep` pages), answered (the
    session said what it gave and keeps), expired (the deadline passed with
    neither) or ended (the session ended). `settled` is set when it leaves
    open."""

    id: int
    session: "Session"
    device: str
    page_size: int
    pages: int  # pages asked for in this event
    keep: int  # pages the session was asked to hold at most
    deadline: float
    reason: str
    state: str = "open"
    answered: bool = False
    bytes_given: int = 0  # from the session's answer
    bytes_kept: int = 0
    why: str = ""
    created: float = field(default_factory=time.monotonic)
    settled: asyncio.Event = field(default_factory=asyncio.Event)

    def settle(self, state: str) -> None:
        if self.state == "open":
            self.state = state
            self.settled.set()


@dataclass(eq=False)
class Ask:
    """An open request to `session`: hold at most `keep` pages on a device by
    `deadline` (wall clock). `events` are the RECLAIM events merged into it;
    once the session answered one of them (`answered`), the ask stands for
    what the session said it keeps: nothing more is pending from it and it
    is not asked again before the deadline."""

    keep: int
    deadline: float
    reason: str
    events: list[Reclaim] = field(default_factory=list)
    answered: bool = False


def guaranteed_pages(s: "Session", pool: "DevicePool") -> int:
    return -(-s.guaranteed_bytes // pool.page_size)


def pending_pages(s: "Session", pool: "DevicePool", now: float) -> int:
    ask = s.asks.get(pool.uuid)
    if ask is None or ask.deadline < now or ask.answered:
        return 0
    return max(0, s.held_pages(pool.uuid) - ask.keep)


def reclaimable(s: "Session", pool: "DevicePool", now: float) -> int:
    """Pages we could still ask `s` for (not already asked; none while its
    answer to an ask stands)."""
    ask = s.asks.get(pool.uuid)
    if ask is not None and ask.answered and ask.deadline >= now:
        return 0
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
        self.answers_total = 0
        self._ids = itertools.count(1)
        # recent RECLAIM events by id (for answers and RequestShrink), oldest first
        self.events: collections.OrderedDict[int, Reclaim] = collections.OrderedDict()

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
        # sessions keeping standby pages give those first (nothing of theirs is in use)
        out.sort(key=lambda s: (-min(s.reclaim_ignored, 1), -min(s.standby_pages(pool.uuid), 1), s.priority, s.last_active))
        return out

    def request(self, pool: "DevicePool", requester: "Session", missing: int, deadline: float) -> list[tuple["Session", int]]:
        """Ask other sessions for `missing` pages by `deadline`, counting
        pages already asked for (none when under MIN_ASK_S is left). Returns
        [(session, pages)] newly asked."""
        now = time.time()
        asked: list[tuple["Session", int]] = []
        if deadline - now < MIN_ASK_S:
            return asked
        outstanding = sum(pending_pages(s, pool, now) for s in self._sessions() if s is not requester)
        need = missing - outstanding
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

    def ask(self, s: "Session", pool: "DevicePool", pages: int, deadline: float, reason: str) -> Reclaim:
        """Ask `s` to give back `pages` more pages of `pool` by `deadline`
        (one RECLAIM event, returned)."""
        now = time.time()
        held = s.held_pages(pool.uuid)
        keep = max(guaranteed_pages(s, pool), held - pending_pages(s, pool, now) - pages)
        cur = s.asks.get(pool.uuid)
        events: list[Reclaim] = []
        if cur is not None and cur.deadline >= now and not cur.answered:
            keep = min(keep, cur.keep)
            deadline = max(deadline, cur.deadline)
            events = [e for e in cur.events if e.state == "open"]
        ev = Reclaim(next(self._ids), s, pool.uuid, pool.page_size, held - keep, keep, deadline, reason)
        ask = Ask(keep, deadline, reason, events + [ev])
        s.asks[pool.uuid] = ask
        self._remember(ev)
        s.reclaim_requests += 1
        self.requests_total += 1
        self.requests_by_reason[reason] = self.requests_by_reason.get(reason, 0) + 1
        self.pages_asked_total += held - keep
        self._post(s, "RECLAIM", {"id": ev.id, "device": pool.uuid, "pages": held - keep, "deadline_unix": deadline, "reason": reason})
        log.info("asked session %d '%s' to give back %d pages of %s by %.2fs from now (%s, reclaim %d)",
                 s.id, s.name, held - keep, pool.uuid, deadline - now, reason, ev.id)
        loop = asyncio.get_running_loop()
        loop.call_later(max(0.0, deadline - now), self._expire, s, pool.uuid, ask)
        return ev

    def _remember(self, ev: Reclaim) -> None:
        self.events[ev.id] = ev
        mono = time.monotonic()
        while self.events:  # keep settled events for 10 minutes, at most 65536 in all
            old = next(iter(self.events.values()))
            if len(self.events) > 65536 or (old.state != "open" and mono - old.created > 600):
                self.events.popitem(last=False)
            else:
                break

    def _expire(self, s: "Session", uuid: str, ask: Ask) -> None:
        if s.asks.get(uuid) is not ask:
            return  # superseded by a later ask, or met: checked there
        del s.asks[uuid]
        met = s.closed or s.held_pages(uuid) <= ask.keep
        for ev in ask.events:
            ev.settle("ended" if s.closed else "met" if met else "expired")
        if not met and not ask.answered:
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
        if not ask.answered:
            self.pages_returned_total += min(freed, max(0, held + freed - ask.keep))
        if held <= ask.keep:
            del s.asks[uuid]
            for ev in ask.events:
                ev.settle("met")

    def answer(self, s: "Session", reclaim_id: int, bytes_given: int, bytes_kept: int, why: str) -> Reclaim:
        """The session's answer to RECLAIM event `reclaim_id`: what it gave
        back for it and what it keeps. The ask it belongs to is settled:
        the session is not counted as ignoring it, nobody waits for the rest,
        and it is not asked again before the ask's deadline."""
        ev = self.events.get(reclaim_id)
        if ev is None or ev.session is not s:
            raise errors.NotFound(f"session {s.id} was sent no reclaim request {reclaim_id} (or it is long settled)")
        self.answers_total += 1
        ask = s.asks.get(ev.device)
        targets = ask.events if ask is not None and ev in ask.events else [ev]
        for e in targets:
            if not e.answered:
                e.answered, e.bytes_given, e.bytes_kept, e.why = True, bytes_given, bytes_kept, why
            e.settle("answered")
        if ask is not None and ev in ask.events:
            ask.answered = True  # stands for what it keeps until its deadline
        held = s.held_pages(ev.device)
        log.info("session %d '%s' answered reclaim %d: gave back %d bytes, keeps %d%s (the daemon's books: %d pages held on %s)",
                 s.id, s.name, reclaim_id, bytes_given, bytes_kept, f": {why}" if why else "", held, ev.device)
        return ev

    def session_ended(self, s: "Session") -> None:
        for ask in s.asks.values():
            for ev in ask.events:
                ev.settle("ended")
        s.asks.clear()

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
