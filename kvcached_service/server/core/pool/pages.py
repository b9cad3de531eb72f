"""A pool's pages and its lists of ready ones.

Who may get a pooled page (invariant 2 of the brief):
    fresh       never handed to anyone: any session may get it.
    by_uid[u]   returned by a session of uid u and zeroed: only uid u may get
                it, because a process of u may still hold a reference (a
                mapping, an imported handle). Another uid gets a new page;
                if the budget is short, u's pooled pages are released first.
A page a session gave back is in neither list until it has been zeroed
(pool.zeroer); then it joins by_uid of its last uid. Taking pages costs
O(pages asked): deques pop from the end.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ....backends.base import PageHandle

if TYPE_CHECKING:
    from ..sessions import Session


class PageState(enum.Enum):
    POOLED = "pooled"
    ZEROING = "zeroing"
    HELD = "held"  # lent to a session (its delivery may still wait for room: SessionPort.delivering)


@dataclass(eq=False, slots=True)
class Page:
    id: int
    device: str  # uuid of the device (pool) it belongs to
    handle: PageHandle
    state: PageState = PageState.POOLED
    session: "Session | None" = None
    uid: int | None = None  # last uid it was handed to; None = never handed out
    pooled_at: float = 0.0
    ident: str = ""  # backend identity, recorded in the journal
    keepers: "set[Session] | None" = None  # sessions keeping an imported handle of it (pool.keepers)
    standby: bool = False  # HELD, but kept mapped by its session as standby (not in use by its engine)


class ReadyPages:
    """The pooled pages that can be lent at once: fresh, and zeroed per uid.
    Owns the two lists; the pool's counts are the pool's."""

    __slots__ = ("fresh", "by_uid", "n")

    def __init__(self) -> None:
        self.fresh: collections.deque[Page] = collections.deque()
        self.by_uid: dict[int, collections.deque[Page]] = {}
        self.n = 0  # pages in both lists: a plain field, read on every Allocate

    def __len__(self) -> int:
        return self.n

    def for_uid(self, uid: int) -> int:
        """Pages a session of `uid` may take now."""
        mine = self.by_uid.get(uid)
        return len(self.fresh) + (len(mine) if mine else 0)

    def put(self, page: Page) -> None:
        """A pooled page joins its list: fresh if never handed out, else its uid's."""
        if page.uid is None:
            self.fresh.append(page)
        else:
            self.by_uid.setdefault(page.uid, collections.deque()).append(page)
        self.n += 1

    def take_if(self, uid: int, n: int) -> list[Page] | None:
        """`n` pages for `uid` (as `take`) if it may take that many now,
        else None and nothing taken: the warm Allocate's one call here."""
        return self.take(uid, n) if self.for_uid(uid) >= n else None

    def take_with_foreign(self, uid: int, n: int, foreign: int) -> tuple[list[Page], list[Page]]:
        """`take(uid, n)` and `take_foreign(uid, foreign)` at once: the pages
        a cold Allocate gets, and the other uids' pages it releases to make
        room."""
        return self.take(uid, n), self.take_foreign(uid, foreign)

    def take(self, uid: int, n: int) -> list[Page]:
        """`n` pages for `uid`: its own first (most recently pooled), then fresh ones."""
        out: list[Page] = []
        mine = self.by_uid.get(uid)
        while mine and len(out) < n:
            out.append(mine.pop())
        if mine is not None and not mine:
            del self.by_uid[uid]
        while len(out) < n:
            out.append(self.fresh.pop())
        self.n -= len(out)
        return out

    def take_foreign(self, uid: int, n: int) -> list[Page]:
        """The oldest pooled pages of other uids, to be released (never reused)."""
        out: list[Page] = []
        if n <= 0:
            return out
        for other in list(self.by_uid):
            if other == uid:
                continue
            dq = self.by_uid[other]
            while dq and len(out) < n:
                out.append(dq.popleft())
            if not dq:
                del self.by_uid[other]
            if len(out) == n:
                break
        self.n -= len(out)
        return out

    def take_idle(self, n: int, cutoff: float) -> list[Page]:
        """Up to `n` pages pooled at or before `cutoff`: uid-bound ones first
        (only their uid can use them), then fresh ones."""
        out: list[Page] = []
        for uid in list(self.by_uid):
            dq = self.by_uid[uid]
            while dq and len(out) < n and dq[0].pooled_at <= cutoff:
                out.append(dq.popleft())
            if not dq:
                del self.by_uid[uid]
        while self.fresh and len(out) < n and self.fresh[0].pooled_at <= cutoff:
            out.append(self.fresh.popleft())
        self.n -= len(out)
        return out

    def take_all(self) -> list[Page]:
        out = list(self.fresh)
        self.fresh.clear()
        for dq in self.by_uid.values():
            out.extend(dq)
        self.by_uid.clear()
        self.n = 0
        return out
