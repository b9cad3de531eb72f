"""The page pool of one device: budget, free lists and exact accounting.

All state here is touched only from the event loop thread, so no locks;
backend calls (create, zero, release) run on the device's worker thread and
are awaited. Counters change *before* an await, so every snapshot adds up:

    pooled + in_use + free == budget        (in pages; times page_size bytes)

where
    pooled  = pages held by no session: ready, being zeroed, or being created
              for the warm pool
    in_use  = pages held by sessions (or being delivered) + pages being
              created for an Allocate
    free    = budget not backed by any page

Who may get a pooled page (invariant 2 of the brief):
    fresh       never handed to anyone: any session may get it.
    by_uid[u]   returned by a session of uid u and zeroed: only uid u may get
                it, because a process of u may still hold a reference (a
                mapping, an imported handle). Another uid gets a new page;
                if the budget is short, u's pooled pages are released first.
Allocation takes O(pages asked) time: deques pop from the end.

A loan (`DevicePool.lend`) is one step with one rollback: admitted (`admit`:
may the session hold that much on this device), acquired, exported. The
pages come back HELD by the session in these books, with the descriptors to
deliver them with; the core books them to the session (and the journal),
the adapter that answers delivers them.

Admission is the budget's question, so it lives here, beside `Budget`: one
function, `admit`, policy only (it reads budgets and limits, raises the
error a client sees, changes nothing). Whether pages can be had *now*
(pooled, free budget, another uid's pooled pages to release) is `acquire`'s
supply question (it raises Shortage); whether other sessions should be
asked to give pages back is elastic.py's. The three limits, on every device:
- session maximum: the pages a session holds never exceed
  min(device budget, max_bytes) (max_bytes 0 = the device budget);
- device budget: a session never holds more than the device's budget;
- sum of guarantees: the guarantees of all open sessions fit in the budget
  of every device (a guarantee applies per device).
Plus the check that belongs with them: a guarantee above the maximum. (The
size of one request, 1..max_pages_per_request, is checked by the core
before the device is looked up.)
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Callable, NamedTuple

from .. import errors
from ..backends.base import Backend, DeviceSpec, PageHandle
from ..config import format_size
from ..fdchannel import close_fds
from .worker import DeviceWorker

if TYPE_CHECKING:
    from .sessions import Session

log = logging.getLogger("kvcached.pool")

class PageIds:
    """The daemon's page-id counter, shared by its pools (a page id names a
    page across devices and restarts). Owned by the Daemon, not global."""

    def __init__(self, start: int = 1):
        self._next = start

    def next(self) -> int:
        n = self._next
        self._next += 1
        return n

    def peek(self) -> int:
        """The id the next page will get (the journal records it)."""
        return self._next

    def continue_from(self, start: int) -> None:
        """After a restart: never reuse a page id the journal knows."""
        self._next = max(self._next, start)


_COMING_WAIT_S = 5.0  # how long an Allocate waits for pages being zeroed/made, without progress
# Pages made per call on the device worker, for an Allocate and for the warm
# pool alike: a large Allocate is made in batches, so the worker's other
# calls (another session's few pages, zeroing, exports) run between them
# instead of waiting for the whole allocation.
CREATE_BATCH = 64


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


@dataclass
class PoolCounters:
    created_total: int = 0
    released_total: int = 0
    allocations_total: int = 0
    allocation_failures_total: int = 0


class Budget(NamedTuple):
    """A device's budget: what the daemon may lend on it now, in pages. What
    admission reads. The configured limit (memory_limit resolved for the
    device), capped by what the device really has: the pages the pool
    accounts for plus the device's free memory (DevicePool.set_supply). A
    new tuple replaces the old one when that changes."""

    device: str
    page_size: int
    pages: int

    @property
    def bytes(self) -> int:
        """The budget in bytes: the one place it is derived."""
        return self.pages * self.page_size


def _label(session) -> str:
    """A session for messages: a label as given, or a Session as `ID 'name'`
    (formatted only when a message is made: admit runs on every Allocate)."""
    return session if isinstance(session, str) else f"{session.id} '{session.name}'"


def admit(
    budgets: list[Budget],
    *,
    session,
    guaranteed_bytes: int,
    max_bytes: int,
    others_guaranteed: int | None = None,
    device: str | None = None,
    held_pages: int = 0,
    more_pages: int = 0,
) -> None:
    """Raise the client's error if `session` (a label for messages, or the Session) may not
    have these limits, or may not hold `held_pages + more_pages` pages on
    `device`. `others_guaranteed`: the guarantees of every other open
    session, given when the limits are set or changed (OpenSession,
    SetSessionLimits), None on an Allocate (the sum was admitted then)."""
    if max_bytes and guaranteed_bytes > max_bytes:
        raise errors.InvalidArgument(f"guaranteed_bytes {guaranteed_bytes} exceeds max_bytes {max_bytes}")
    if guaranteed_bytes and others_guaranteed is not None:
        total = others_guaranteed + guaranteed_bytes
        for b in budgets:
            if total > b.bytes:
                raise errors.ResourceExhausted(
                    f"guarantees would total {format_size(total)}, more than device {b.device}'s budget {format_size(b.bytes)}"
                )
    if device is None:
        return
    (b,) = [x for x in budgets if x.device == device]
    cap = b.pages if not max_bytes else min(b.pages, max_bytes // b.page_size)
    if held_pages + more_pages > cap:
        raise errors.ResourceExhausted(
            f"session {_label(session)} holds {held_pages} pages on {b.device}; {more_pages} more would exceed its maximum of {cap} pages"
            + (f" (max_bytes {format_size(max_bytes)})" if max_bytes else " (the device budget)")
        )


@dataclass(frozen=True)
class Books:
    """One device's books at one instant, in pages: the read model every
    reader uses (GetStats, metrics, sd_notify, kvcachedctl through GetStats,
    tests). Only DevicePool writes the numbers it is made from.

        pooled + in_use + free == budget
    """

    budget: Budget
    pooled: int
    in_use: int
    free: int
    created_total: int
    released_total: int
    allocations_total: int
    allocation_failures_total: int
    unavailable: int = 0  # pages of the configured limit the device does not have (not in budget)

    @property
    def device(self) -> str:
        return self.budget.device

    @property
    def page_size(self) -> int:
        return self.budget.page_size

    @property
    def budget_pages(self) -> int:
        return self.budget.pages

    @property
    def budget_bytes(self) -> int:
        return self.budget.bytes

    @property
    def pooled_bytes(self) -> int:
        return self.pooled * self.page_size

    @property
    def in_use_bytes(self) -> int:
        return self.in_use * self.page_size

    @property
    def free_bytes(self) -> int:
        return self.free * self.page_size

    @property
    def unavailable_bytes(self) -> int:
        return self.unavailable * self.page_size

    def check(self) -> None:
        """Assert the books add up (GetStats calls it on every snapshot)."""
        assert self.pooled + self.in_use + self.free == self.budget_pages, self
        assert self.free >= 0, f"budget overdrawn by {-self.free} pages"


class Shortage(errors.ResourceExhausted):
    """Not enough budget; carries the numbers for the message and for reclaim."""

    def __init__(self, message: str, missing: int):
        super().__init__(message)
        self.missing = missing


class Loan(NamedTuple):
    """Pages lent to a session (DevicePool.lend): HELD by it in the pool's
    books, and the descriptors to deliver them with, in order. When `fresh`
    (the backend made a new export for this delivery: CUDA) whoever
    delivers them closes the fds once sent, or not sent; otherwise they are
    the pages' own (host memfds) and stay open."""

    pages: list[Page]
    fds: list[int]
    fresh: bool


class DevicePool:
    def __init__(
        self,
        backend: Backend,
        spec: DeviceSpec,
        worker: DeviceWorker,
        *,
        page_ids: PageIds,
        page_size: int,
        budget_bytes: int,
        warm_pages: int,
        idle_seconds: float,
        zero_pages: bool,
        tasks: set[asyncio.Task] | None = None,
    ):
        self.backend = backend
        self.spec = spec
        self.uuid = spec.uuid  # an attribute, not a property: read on every Allocate
        self.worker = worker
        self.page_ids = page_ids
        self.page_size = page_size
        self.limit_pages = budget_bytes // page_size  # the configured limit
        self.budget_pages = self.limit_pages  # the limit capped by supply (set_supply)
        self.budget = Budget(spec.uuid, page_size, self.budget_pages)
        self.warm_pages = min(warm_pages, self.budget_pages)
        self.idle_seconds = idle_seconds
        self.zero_pages = zero_pages
        self.pages: dict[int, Page] = {}
        self._fresh: collections.deque[Page] = collections.deque()
        self._by_uid: dict[int, collections.deque[Page]] = {}
        self.n_pooled = 0
        self.n_held = 0
        self.n_creating = 0
        self.counters = PoolCounters()
        self._changed: asyncio.Event | None = None  # made by the first waiter, set and dropped by _notify
        self._refilling = False
        self._no_refill = False  # set at shutdown: no more warm pages
        # why the last warm-page creation failed; None once a refill found
        # nothing left to create (filled, or the rest of the budget in use)
        # (start-up keeps health NOT_SERVING while it is set: main.py)
        self.fill_error: str | None = None
        self._ident_distinct: bool | None = None  # identities_distinct(), once decided
        # Called with (device uuid, pages) whenever pages return to the pool.
        self.on_pages_returned: Callable[[str, int], None] | None = None
        # the zeroing tasks of pages given back (the daemon's own set: shutdown waits for them)
        self.tasks: set[asyncio.Task] = tasks if tasks is not None else set()

    # ---- accounting ----------------------------------------------------
    @property
    def n_in_use(self) -> int:
        return self.n_held + self.n_creating

    @property
    def n_free(self) -> int:
        return self.budget_pages - self.n_pooled - self.n_in_use

    def n_ready_for(self, uid: int) -> int:
        mine = self._by_uid.get(uid)
        return len(self._fresh) + (len(mine) if mine else 0)

    def n_ready_total(self) -> int:
        return len(self._fresh) + sum(len(d) for d in self._by_uid.values())

    def available_for(self, uid: int) -> int:
        """Pages a session of `uid` could get now without anyone freeing."""
        return self.n_ready_total() + self.n_free

    def books(self) -> Books:
        """A frozen snapshot of the books (see Books)."""
        c = self.counters
        return Books(
            self.budget, self.n_pooled, self.n_in_use, self.n_free,
            c.created_total, c.released_total, c.allocations_total, c.allocation_failures_total,
            max(0, self.limit_pages - self.budget_pages),
        )

    # ---- supply: what the device really has ---------------------------
    def set_supply(self, device_free_bytes: int) -> tuple[int, int] | None:
        """The device reports `device_free_bytes` free (cuMemGetInfo; host:
        MemAvailable). The budget becomes the configured limit capped at the
        pages this pool accounts for (pooled + in use, orphans included) plus
        the free ones, and never below what it accounts for: memory the
        daemon cannot account for (other processes, pages of a previous
        daemon its clients still map) is unavailable, not free. Returns
        (old, new) budget pages when the budget changed."""
        accounted = self.n_pooled + self.n_in_use
        supply = accounted + max(0, device_free_bytes) // self.page_size
        pages = max(accounted, min(self.limit_pages, supply))
        if pages == self.budget_pages:
            return None
        old = self.budget_pages
        self.budget_pages = pages
        self.budget = Budget(self.uuid, self.page_size, pages)
        if pages > old:
            self._notify(0)  # a waiting Allocate may fit now
        return old, pages

    def check(self) -> None:
        """Assert the books add up (GetStats calls it on every snapshot)."""
        self.books().check()

    def note_failure(self) -> None:
        """An Allocate this pool could not satisfy (after any wait)."""
        self.counters.allocation_failures_total += 1

    # ---- pages of a previous daemon (journal) ---------------------------
    def hold_orphans(self, n: int) -> None:
        """Pages a previous daemon lent to sessions that may still resume:
        they count as in use (their memory is still mapped by the clients)
        until they are adopted or forgotten."""
        self.n_held += n

    def forget_orphans(self, n: int) -> None:
        """Orphan pages nobody will claim (grace over, or left out of a
        resume): their budget is free again; the memory stays with whoever
        still maps it."""
        assert 0 <= n <= self.n_held
        self.n_held -= n

    async def identities_distinct(self) -> bool:
        """Whether Backend.identity tells this device's pages apart: two
        pages this daemon made (pooled or lent now; else two made for the
        question and released) must have different identities. A driver
        whose exported fds are all fds of one device node (the same fstat
        for every export) fails, and then nothing a client re-sends can be
        matched to the journal (docs/cuda.md, "Page identity"). Decided once
        per daemon, before any page of this device is adopted, so every page
        compared was created here. False when it cannot be decided (the
        driver refused to create the pages)."""
        if self._ident_distinct is not None:
            return self._ident_distinct
        own = [p.handle for p in self.pages.values()][:2]
        made: list[PageHandle] = []
        try:
            if len(own) < 2:
                made = await self.worker.call(self.backend.create_pages, self.spec.ordinal, 2 - len(own), self.page_size, False)
                own += made
            a, b = (self.backend.identity(h.fd) for h in own)
        except Exception as exc:  # noqa: BLE001 - undecided means unsafe
            log.warning("device %s: cannot tell whether exported fds identify their pages (%s); resumes will not adopt pages",
                        self.uuid, exc)
            return False
        finally:
            if made:
                try:
                    await self.worker.call(self.backend.release_pages, self.spec.ordinal, made)
                except Exception as exc:  # noqa: BLE001
                    log.error("device %s: releasing the identity probe's pages failed: %s", self.uuid, exc)
        self._ident_distinct = a != b
        if self._ident_distinct:
            log.info("device %s: exported fds identify their pages (fstat differs per page): resumes adopt pages", self.uuid)
        else:
            log.warning("device %s: every exported fd has the same fstat identity (%s): a resumed session's pages cannot be "
                        "told apart, so resumes with pages are refused (docs/cuda.md, \"Page identity\")", self.uuid, a)
        return self._ident_distinct

    async def import_pages(self, fds: list[int]) -> list[PageHandle]:
        """Handles for pages a resuming client sent back (the backend takes
        the fds). Not in the books until `adopt`."""
        return await self.worker.call(self.backend.adopt_pages, self.spec.ordinal, fds, self.page_size)

    async def release_handles(self, handles: list[PageHandle]) -> None:
        """Undo import_pages (a resume that failed after importing)."""
        await self.worker.call(self.backend.release_pages, self.spec.ordinal, handles)

    def adopt(self, session: "Session", adopted: list[tuple[int, PageHandle, str]]) -> list[Page]:
        """Orphan pages a resuming client proved it holds, as (page id,
        handle, identity): they become the session's HELD pages. They were
        counted in use since hold_orphans, so the counts do not change."""
        out = []
        for pid, handle, ident in adopted:
            page = Page(id=pid, device=self.uuid, handle=handle, state=PageState.HELD, session=session,
                        uid=session.uid, ident=ident)
            self.pages[pid] = page
            out.append(page)
        return out

    # ---- allocation ----------------------------------------------------
    async def lend(self, session: "Session", count: int,
                   when_short: Callable[[Shortage], Awaitable[None]] | None = None) -> Loan:
        """A loan of `count` pages to `session`, as one step:
        1. admit it: the session's maximum on this device (`admit`);
        2. acquire the pages; when the budget is short, `when_short(shortage)`
           decides (it raises to give up, or returns to try again; None:
           the Shortage is raised);
        3. export their fds.
        The pages come back HELD by `session` in these books; booking them
        to the session (and the journal) and delivering them is the
        caller's, and so is giving back (`give_back_now`) a loan it could
        not complete. A failure after
        step 2 gives the pages back to this pool once, closes any fresh
        export, and propagates; pages acquired or exported for a session
        that ended meanwhile go back too (FailedPrecondition)."""
        admit([self.budget], session=session, guaranteed_bytes=session.guaranteed_bytes, max_bytes=session.max_bytes,
              device=self.uuid, held_pages=session.held_by_device.get(self.uuid, 0), more_pages=count)
        while True:
            try:
                pages = await self.acquire(session, count)
                break
            except Shortage as short:
                if when_short is None:
                    raise
                await when_short(short)
        fds: list[int] = []
        try:
            if not session.closed:
                fds = await self.export_fds(pages)
            if session.closed:
                # The session ended while its pages were being made or exported: nobody got them.
                raise errors.FailedPrecondition(f"session {session.id} closed while allocating")
        except BaseException:
            if self.backend.fresh_exports:
                close_fds(fds)
            self.give_back_now(pages)  # never the session's
            raise
        return Loan(pages, fds, self.backend.fresh_exports)

    async def acquire(self, session: "Session", count: int) -> list[Page]:
        """Hand `count` pages to `session`, all or nothing: they come back
        HELD by it (in these books; the session's own are the caller's).
        Raises Shortage when the budget cannot cover it right now."""
        uid = session.uid
        while True:
            ready = self.n_ready_for(uid)
            take = min(count, ready)
            create = count - take
            evict = max(0, create - self.n_free)
            if not evict or evict <= self.n_ready_total() - ready:
                break
            # Short only by pages on their way into the pool (being zeroed, or
            # made for the warm pool): wait for them instead of refusing; a
            # slow device (zeroing lands at synchronize) would otherwise fail
            # an Allocate the budget covers.
            coming = self.n_pooled - self.n_ready_total()
            if coming <= 0 or evict > self.n_ready_total() - ready + coming:
                raise Shortage(self._shortage_message(session, count), create - self.n_free - (self.n_ready_total() - ready))
            before = (self.n_ready_total(), coming)
            await self.wait_changed(_COMING_WAIT_S)
            if (self.n_ready_total(), self.n_pooled - self.n_ready_total()) == before:  # nothing moved: stuck
                raise Shortage(self._shortage_message(session, count), create - self.n_free - (self.n_ready_total() - ready))
        got: list[Page] = self._take_ready(uid, take)
        victims = self._take_foreign(uid, evict)
        # The pages taken count as in use from now on (not as free budget
        # while we await), and the budget is reserved for the new ones.
        self.n_held += len(got)
        self.n_creating += create
        try:
            if victims:
                await self._release(victims)
            new_handles = await self._create(create) if create else []
        except BaseException:
            self.n_creating -= create
            self.n_held -= len(got)
            self._put_back(got)
            raise
        self.n_creating -= create
        now = time.monotonic()
        for h in new_handles:
            page = Page(id=self.page_ids.next(), device=self.uuid, handle=h, pooled_at=now)
            self.pages[page.id] = page
            got.append(page)
        self.counters.created_total += len(new_handles)
        for page in got:
            page.state = PageState.HELD
            page.session = session
            page.uid = uid
        self.n_held += len(new_handles)
        self.counters.allocations_total += 1
        self._maybe_refill()
        return got

    async def _create(self, count: int) -> list[PageHandle]:
        """create_pages on the worker, CREATE_BATCH pages per call (other
        calls queued meanwhile run between them). All or nothing: if a batch
        fails, or the caller is cancelled (its client went away), the pages
        made so far, and those of a batch still being made, are released,
        never leaked."""
        made: list[PageHandle] = []

        def release(handles: list[PageHandle]) -> None:
            if handles:
                asyncio.ensure_future(self.worker.call(self.backend.release_pages, self.spec.ordinal, handles))

        while len(made) < count:
            n = min(CREATE_BATCH, count - len(made))
            fut = asyncio.ensure_future(self.worker.call(self.backend.create_pages, self.spec.ordinal, n, self.page_size, self.zero_pages))
            try:
                made += await asyncio.shield(fut)
            except asyncio.CancelledError:
                fut.add_done_callback(lambda f: release(f.result()) if not f.cancelled() and f.exception() is None else None)
                release(made)
                raise
            except BaseException:
                release(made)
                raise
        return made

    async def export_fds(self, pages: list[Page]) -> list[int]:
        """The descriptors of `pages` (backend.export_fds): made on this
        thread when that needs no driver call, else on the device worker.
        Fresh exports (backend.fresh_exports) are the caller's to close."""
        now = self.export_fds_now(pages)
        return now if now is not None else await self.export_fds_on_worker(pages)

    def export_fds_now(self, pages: list[Page]) -> list[int] | None:
        """The descriptors to deliver for `pages` (backend.export_fds), made
        on this thread when that needs no driver call: the host pages' own
        fds, or CUDA pages that carry a ready export (new fds the caller
        closes once sent). None when the backend must export on the device
        worker: then export_fds_on_worker."""
        be = self.backend
        handles = [p.handle for p in pages]
        if be.fresh_exports and not be.exports_ready(handles):
            return None
        return be.export_fds(self.spec.ordinal, handles)

    async def export_fds_on_worker(self, pages: list[Page]) -> list[int]:
        """export_fds on the device worker (the pages need a driver call to
        export). If the caller is cancelled meanwhile, the fds made are
        closed."""
        be = self.backend
        handles = [p.handle for p in pages]
        fut = asyncio.ensure_future(self.worker.call(be.export_fds, self.spec.ordinal, handles))
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            def close(f: asyncio.Future) -> None:
                if not f.cancelled() and f.exception() is None:
                    close_fds(f.result())
            fut.add_done_callback(close)
            raise

    def _take_ready(self, uid: int, n: int) -> list[Page]:
        out: list[Page] = []
        mine = self._by_uid.get(uid)
        while mine and len(out) < n:
            out.append(mine.pop())
        if mine is not None and not mine:
            del self._by_uid[uid]
        while len(out) < n:
            out.append(self._fresh.pop())
        self.n_pooled -= len(out)
        return out

    def _take_foreign(self, uid: int, n: int) -> list[Page]:
        """Oldest pooled pages of other uids, to be released (never reused)."""
        out: list[Page] = []
        if n <= 0:
            return out
        for other in list(self._by_uid):
            if other == uid:
                continue
            dq = self._by_uid[other]
            while dq and len(out) < n:
                out.append(dq.popleft())
            if not dq:
                del self._by_uid[other]
            if len(out) == n:
                break
        self.n_pooled -= len(out)
        return out

    def _put_back(self, pages: list[Page]) -> None:
        """Undo _take_ready (failure before anything was handed out)."""
        for page in pages:
            self._pool(page, time.monotonic())

    def _pool(self, page: Page, now: float) -> None:
        page.state = PageState.POOLED
        page.session = None
        page.pooled_at = now
        if page.uid is None:
            self._fresh.append(page)
        else:
            self._by_uid.setdefault(page.uid, collections.deque()).append(page)
        self.n_pooled += 1

    def _shortage_message(self, session: "Session", count: int) -> str:
        holders = self.holders()
        who = ", ".join(f"session {sid} '{name}' (uid {uid}) holds {format_size(n * self.page_size)}" for sid, name, uid, n in holders[:5])
        return (
            f"device {self.uuid}: cannot allocate {count} pages ({format_size(count * self.page_size)}) "
            f"for session {session.id} '{session.name}': budget {format_size(self.budget.bytes)}, "
            f"{self.n_free} pages free, {self.n_ready_total()} pooled, {self.n_held} held by sessions"
            + (f"; {who}" if who else "")
        )

    def holders(self) -> list[tuple[int, str, int, int]]:
        """(session id, name, uid, pages) of sessions holding pages here, most first."""
        counts: dict[int, list] = {}
        for page in self.pages.values():
            s = page.session
            if s is not None:
                entry = counts.setdefault(s.id, [s.id, s.name, s.uid, 0])
                entry[3] += 1
        return sorted((tuple(v) for v in counts.values()), key=lambda e: -e[3])  # type: ignore[misc]

    # ---- returning pages -----------------------------------------------
    def give_back_now(self, pages: list[Page]) -> asyncio.Task | None:
        """Pages a session freed (or held when it ended), given back without
        waiting: they leave in_use at once. Pages nothing needs to zero
        (nobody wrote them, or --no-zero-pages) are pooled for their uid
        before this returns, without a trip to the device worker: None.
        Otherwise a Task (in `tasks`) zeroes them on the worker, then pools
        them; it finishes even if whoever waits for it is cancelled (its
        client died mid-Free), so no page stays "being zeroed" forever."""
        if not pages:
            return None
        for page in pages:
            page.state = PageState.ZEROING
            page.session = None
        self.n_held -= len(pages)
        self.n_pooled += len(pages)
        dirty = self.backend.needs_zeroing([p.handle for p in pages]) if self.zero_pages else []
        if not dirty:
            self._pooled_now(pages)
            return None
        task = asyncio.get_running_loop().create_task(self._zero_and_pool(pages, dirty))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def give_back(self, pages: list[Page]) -> None:
        """give_back_now, then wait until the pages are pooled."""
        task = self.give_back_now(pages)
        if task is not None:
            await asyncio.shield(task)

    def _pooled_now(self, pages: list[Page]) -> None:
        now = time.monotonic()
        self.n_pooled -= len(pages)
        for page in pages:
            self._pool(page, now)
        self._notify(len(pages))

    async def _zero_and_pool(self, pages: list[Page], dirty: list[PageHandle]) -> None:
        try:
            await self.worker.call(self.backend.zero_pages, self.spec.ordinal, dirty)
        except Exception as exc:  # a page we cannot zero must never be handed out again
            log.error("device %s: zeroing %d pages failed (%s); releasing them", self.uuid, len(pages), exc)
            self.n_pooled -= len(pages)
            await self._release(pages)
            self._notify(0)
            return
        self._pooled_now(pages)

    def _notify(self, n: int) -> None:
        if self._changed is not None:  # someone waits for pages
            self._changed.set()
            self._changed = None
        if n and self.on_pages_returned is not None:
            self.on_pages_returned(self.uuid, n)

    async def wait_changed(self, timeout: float) -> None:
        """Wait until pages return to the pool (or timeout)."""
        ev = self._changed
        if ev is None:
            ev = self._changed = asyncio.Event()
        try:
            await asyncio.wait_for(ev.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    async def _release(self, pages: list[Page]) -> None:
        """Pages already out of the books: close and free them."""
        for page in pages:
            self.pages.pop(page.id, None)
        self.counters.released_total += len(pages)
        try:
            await self.worker.call(self.backend.release_pages, self.spec.ordinal, [p.handle for p in pages])
        except Exception as exc:
            log.error("device %s: releasing %d pages failed: %s", self.uuid, len(pages), exc)

    # ---- warm pages and idle trimming -----------------------------------
    async def prefill(self) -> None:
        """Create the warm pages (start-up). Returns when the warm target is
        met, creation failed (logged), or stop_refilling() was called."""
        await self._refill()

    async def retry_fill(self) -> None:
        """Another try at the warm pages after fill_error was set (start-up
        retries until the pool is filled); a refill already running is that
        try."""
        if not self._refilling:
            await self._refill()

    def stop_refilling(self) -> None:
        """No more warm pages: a prefill or refill in progress ends after
        the batch the worker is creating (at most CREATE_BATCH pages)."""
        self._no_refill = True

    def _maybe_refill(self) -> None:
        if not self._no_refill and not self._refilling and self.n_ready_total() < self.warm_pages and self.n_free > 0:
            self._refilling = True
            asyncio.get_running_loop().create_task(self._refill())

    async def _refill(self) -> None:
        self._refilling = True
        try:
            while not self._no_refill:
                want = min(self.warm_pages - self.n_ready_total(), self.n_free, CREATE_BATCH)
                if want <= 0:  # filled, or the rest of the budget is in use: nothing failed
                    self.fill_error = None
                    return
                self.n_pooled += want  # warm pages in the making are pooled, not in use
                try:
                    handles = await self.worker.call(self.backend.create_pages, self.spec.ordinal, want, self.page_size, self.zero_pages)
                except Exception as exc:
                    log.warning("device %s: warm page creation failed: %s", self.uuid, exc)
                    self.fill_error = str(exc) or type(exc).__name__
                    return
                finally:
                    self.n_pooled -= want
                now = time.monotonic()
                for h in handles:
                    page = Page(id=self.page_ids.next(), device=self.uuid, handle=h)
                    self.pages[page.id] = page
                    self._pool(page, now)
                self.counters.created_total += len(handles)
                self._notify(len(handles))
        finally:
            self._refilling = False

    async def trim_idle(self, now: float | None = None) -> int:
        """Release pooled pages beyond the warm target that sat idle longer
        than idle_seconds: uid-bound pages first (only their uid can use
        them), then fresh ones. Returns pages released."""
        now = time.monotonic() if now is None else now
        excess = self.n_ready_total() - self.warm_pages
        if excess <= 0:
            return 0
        cutoff = now - self.idle_seconds
        victims: list[Page] = []
        for uid in list(self._by_uid):
            dq = self._by_uid[uid]
            while dq and len(victims) < excess and dq[0].pooled_at <= cutoff:
                victims.append(dq.popleft())
            if not dq:
                del self._by_uid[uid]
        while self._fresh and len(victims) < excess and self._fresh[0].pooled_at <= cutoff:
            victims.append(self._fresh.popleft())
        if victims:
            self.n_pooled -= len(victims)
            await self._release(victims)
        return len(victims)

    async def release_all_pooled(self) -> int:
        victims = list(self._fresh)
        self._fresh.clear()
        for dq in self._by_uid.values():
            victims.extend(dq)
        self._by_uid.clear()
        self.n_pooled -= len(victims)
        if victims:
            await self._release(victims)
        return len(victims)

    def release_everything_sync(self) -> None:
        """Shutdown: every page still known (pooled or held) is released."""
        handles = [p.handle for p in self.pages.values()]
        self.pages.clear()
        self._fresh.clear()
        self._by_uid.clear()
        self.counters.released_total += len(handles)
        self.n_pooled = self.n_held = 0
        if handles:
            self.worker.call_sync(self.backend.release_pages, self.spec.ordinal, handles)
