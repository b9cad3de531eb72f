"""The page pool of one device: its parts, and the loan.

All state here is touched only from the event loop thread, so no locks;
backend calls run on worker threads and are awaited. Counters change
*before* an await, so every snapshot adds up (books.py). The pool is made
of parts that each own their state:

    Counts      the budget and the page counts (books.py)
    ReadyPages  the pages that can be lent at once: fresh, and per uid (pages.py)
    Zeroer      the pages given back, zeroed in the background on a worker
                of its own (zeroer.py)
    Loan        the pages lent and the descriptors that deliver them (loan.py)
    Keepers     who keeps an imported handle of which pooled page, and the
                DROP asks answered before such a page is released (keepers.py)

and DevicePool, which composes them: a loan (`lend`) is one step with one
rollback: admitted (`admit`: may the session hold that much on this device),
acquired (`acquire`: ready pages, pages being zeroed for this uid, or new
ones), exported (`export`). The pages come back HELD by the session in these
books, with the descriptors to deliver them with; the core books them to
the session (and the journal), the adapter that answers delivers them.

No driver call is on a warm loan's path: a page keeps one exported
descriptor for its life (the host backend's memfd; a CUDA page's export,
made on the worker when the page is created, while the daemon's fd cap
allows: CudaBackend.kept_export_cap), and a loan sends that one as it is.
A Free is answered as soon as the books say the pages are back; the Zeroer
does the rest.

Admission is the budget's question (`admit`, books.py). Whether pages can be
had *now* (ready, being zeroed, free budget, another uid's pooled pages to
release) is `acquire`'s supply question (it raises Shortage); whether other
sessions should be asked to give pages back is elastic.py's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Awaitable, Callable

from .... import errors
from ....backends.base import Backend, DeviceSpec, PageHandle
from ....config import format_size
from ....fdchannel import close_fds
from ..worker import DeviceWorker
from .books import Books, Budget, Counts, PageIds, PoolCounters, Shortage, admit
from .keepers import Keepers
from .loan import Loan
from .pages import Page, PageState, ReadyPages
from .zeroer import Zeroer

if TYPE_CHECKING:
    from ..sessions import Session

log = logging.getLogger("kvcached.pool")

_COMING_WAIT_S = 5.0  # how long an Allocate waits for pages being zeroed/made, without progress
# Pages made per call on the device worker, for an Allocate and for the warm
# pool alike: a large Allocate is made in batches, so the worker's other
# calls (another session's few pages, releases) run between them instead of
# waiting for the whole allocation.
CREATE_BATCH = 64


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
        zero_worker: DeviceWorker | None = None,
    ):
        self.backend = backend
        self.spec = spec
        self.uuid = spec.uuid  # an attribute, not a property: read on every Allocate
        self.worker = worker
        self.page_ids = page_ids
        self.page_size = page_size
        self.counts = Counts(budget_bytes // page_size)
        self.budget = Budget(spec.uuid, page_size, self.counts.budget_pages)
        self.warm_pages = min(warm_pages, self.counts.budget_pages)
        self.idle_seconds = idle_seconds
        self.zero_pages = zero_pages
        self.pages: dict[int, Page] = {}
        self.ready = ReadyPages()
        self.counters = PoolCounters()
        # the background tasks (the zeroer's, warm refills): the daemon's own set, shutdown waits for them
        self.tasks: set[asyncio.Task] = tasks if tasks is not None else set()
        self.zeroer = Zeroer(backend, spec.ordinal, zero_worker or worker, done=self._zeroed, failed=self._zero_failed,
                             tasks=self.tasks)
        self.keepers = Keepers(spec.uuid)  # the daemon sets its ask/silent/timeout
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

    # ---- accounting ----------------------------------------------------
    @property
    def limit_pages(self) -> int:
        return self.counts.limit_pages

    @property
    def budget_pages(self) -> int:
        return self.counts.budget_pages

    @property
    def n_pooled(self) -> int:
        return self.counts.pooled

    @property
    def n_in_use(self) -> int:
        return self.counts.in_use

    def n_ready_for(self, uid: int) -> int:
        return self.ready.for_uid(uid)

    def n_ready_total(self) -> int:
        return self.ready.n

    def available_for(self, uid: int) -> int:
        """Pages a session of `uid` could get now without anyone freeing."""
        return self.ready.n + self.counts.free

    def books(self) -> Books:
        """A frozen snapshot of the books (see Books)."""
        c, n, z = self.counters, self.counts, self.zeroer.counters
        return Books(
            self.budget, n.pooled, n.in_use, n.free,
            c.created_total, c.released_total, c.allocations_total, c.allocation_failures_total,
            max(0, n.limit_pages - n.budget_pages), len(self.zeroer),
            z.pages_total, z.batches_total, z.failures_total, z.waits_total, z.wait_seconds_total,
            len(self.keepers), self.keepers.counters.drops_total, self.keepers.counters.silent_total, n.standby,
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
        n = self.counts
        accounted = n.pooled + n.in_use
        supply = accounted + max(0, device_free_bytes) // self.page_size
        pages = max(accounted, min(n.limit_pages, supply))
        if pages == n.budget_pages:
            return None
        old = n.budget_pages
        n.budget_pages = pages
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
        self.counts.held += n

    def forget_orphans(self, n: int) -> None:
        """Orphan pages nobody will claim (grace over, or left out of a
        resume): their budget is free again; the memory stays with whoever
        still maps it."""
        assert 0 <= n <= self.counts.held
        self.counts.held -= n

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
        own = [p.handle for p in self.pages.values() if p.handle.fd >= 0][:2]
        made: list[PageHandle] = []
        owned: list[int] = []
        try:
            if len(own) < 2:
                made = await self.worker.call(self.backend.create_pages, self.spec.ordinal, 2 - len(own), self.page_size, False)
                own += made
            fds = [h.fd for h in own]
            if any(fd < 0 for fd in fds):  # pages that keep no export: export them for the question
                owned = await self.worker.call(self.backend.export_fds, self.spec.ordinal, own)
                fds = owned
            a, b = (self.backend.identity(fd) for fd in fds)
        except Exception as exc:  # noqa: BLE001 - undecided means unsafe
            log.warning("device %s: cannot tell whether exported fds identify their pages (%s); resumes will not adopt pages",
                        self.uuid, exc)
            return False
        finally:
            if self.backend.fresh_exports:
                close_fds(owned)
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

    # ---- the loan ------------------------------------------------------
    async def lend(self, session: "Session", count: int,
                   when_short: Callable[[Shortage], Awaitable[None]] | None = None) -> Loan:
        """A loan of `count` pages to `session`, as one step:
        1. admit it: the session's maximum on this device (`admit`);
        2. acquire the pages; when the budget is short, `when_short(shortage)`
           decides (it raises to give up, or returns to try again; None:
           the Shortage is raised);
        3. their descriptors (`export`).
        The pages come back HELD by `session` in these books; booking them
        to the session (and the journal) and delivering them is the
        caller's, and so is giving back (`give_back_now`) a loan it could
        not complete, and closing it (`Loan.close`) once delivered. A
        failure after step 2 gives the pages back to this pool once, closes
        what the loan owned, and propagates; pages acquired or exported for
        a session that ended meanwhile go back too (FailedPrecondition)."""
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
        loan: Loan | None = None
        try:
            if not session.closed:
                loan = await self.export(pages)
            if session.closed:
                # The session ended while its pages were being made or exported: nobody got them.
                raise errors.FailedPrecondition(f"session {session.id} closed while allocating")
        except BaseException:
            if loan is not None:
                loan.close()
            self.give_back_now(pages)  # never the session's
            raise
        return loan  # type: ignore[return-value]

    def export_now(self, pages: list[Page]) -> Loan | None:
        """The loan of `pages` with the descriptors they keep (no call, no
        new fd), or None when some page keeps none (then `export`)."""
        fds = [p.handle.fd for p in pages]
        if min(fds, default=0) < 0:
            return None
        return Loan(pages, fds)

    async def export(self, pages: list[Page]) -> Loan:
        """The loan of `pages`: their kept descriptors, and for the pages
        that keep none an export made on the device worker for this delivery
        (owned by the loan). If the caller is cancelled meanwhile, the fds
        made are closed."""
        loan = self.export_now(pages)
        if loan is not None:
            return loan
        missing = [p for p in pages if p.handle.fd < 0]
        fut = asyncio.ensure_future(self.worker.call(self.backend.export_fds, self.spec.ordinal, [p.handle for p in missing]))
        try:
            made = await asyncio.shield(fut)
        except asyncio.CancelledError:
            def close(f: asyncio.Future) -> None:
                if not f.cancelled() and f.exception() is None:
                    close_fds(f.result())
            fut.add_done_callback(close)
            raise
        by_page = dict(zip((id(p) for p in missing), made))
        fds = [p.handle.fd if p.handle.fd >= 0 else by_page[id(p)] for p in pages]
        return Loan(pages, fds, tuple(made) if self.backend.fresh_exports else ())

    async def export_fds(self, pages: list[Page]) -> tuple[list[int], list[int]]:
        """(descriptors of `pages`, the ones made for the caller, which it
        closes): for readers outside a loan (the page store)."""
        loan = await self.export(pages)
        return loan.fds, list(loan.owned)

    async def acquire(self, session: "Session", count: int) -> list[Page]:
        """Hand `count` pages to `session`, all or nothing: they come back
        HELD by it (in these books; the session's own are the caller's).
        Ready pages first (the warm path: no await); else `_plan` says what
        to take, release and make, waiting for pages on their way when that
        is cheaper or the only way, and `_make_up` does it. Raises Shortage
        when the budget cannot cover it right now."""
        got = self.ready.take_if(session.uid, count)
        if got is not None:  # the warm path: ready pages only, no await
            n = self.counts
            n.pooled -= count
            n.held += count
            return self._handed(got, session)
        take, evict, create = await self._plan(session, count)
        return self._handed(await self._make_up(session.uid, take, evict, create), session)

    async def _plan(self, session: "Session", count: int) -> tuple[int, int, int]:
        """(ready pages to take, other uids' pooled pages to release, pages
        to create) for an Allocate of `count` that ready pages alone do not
        cover. When pages of this uid being zeroed cover the rest, it waits
        for those rather than making new ones; when the budget is short only
        by pages on their way into the pool, it waits for them instead of
        refusing (a slow device would otherwise fail an Allocate the budget
        covers)."""
        uid = session.uid
        n = self.counts
        waited_since: float | None = None
        try:
            while True:
                ready = self.ready.for_uid(uid)
                take = min(count, ready)
                if take < count and count - take <= self.zeroer.for_uid(uid):
                    # Pages of this uid on their way back cover the rest:
                    # cheaper than new ones. (When they cannot, waiting for
                    # them helps no more than the budget below says.)
                    if waited_since is None:
                        waited_since = time.monotonic()
                        self.zeroer.counters.waits_total += 1
                    before = (self.ready.n, len(self.zeroer))
                    await self.wait_changed(_COMING_WAIT_S)
                    if (self.ready.n, len(self.zeroer)) != before:
                        continue
                    # no progress: fall through and make what is missing
                create = count - take
                evict = max(0, create - n.free)
                others = self.ready.n - ready  # other uids' pooled pages
                if not evict or evict <= others:
                    return take, evict, create
                coming = n.pooled - self.ready.n  # being zeroed, or made for the warm pool
                if coming <= 0 or evict > others + coming:
                    raise Shortage(self._shortage_message(session, count), evict - others)
                before = (self.ready.n, coming)
                await self.wait_changed(_COMING_WAIT_S)
                if (self.ready.n, n.pooled - self.ready.n) == before:  # nothing moved: stuck
                    raise Shortage(self._shortage_message(session, count), evict - others)
        finally:
            if waited_since is not None:
                self.zeroer.counters.wait_seconds_total += time.monotonic() - waited_since

    async def _make_up(self, uid: int, take: int, evict: int, create: int) -> list[Page]:
        """`_plan`'s answer carried out: `take` ready pages, `evict` pooled
        pages of other uids released, `create` new pages, all counted HELD
        (the pages taken count as in use from now on, not as free budget
        while it awaits, and the budget is reserved for the new ones)."""
        n = self.counts
        got, victims = self.ready.take_with_foreign(uid, take, evict)
        n.pooled -= len(got) + len(victims)
        n.held += len(got)
        n.creating += create
        try:
            if victims:
                await self.keepers.release_ready(victims)
                await self._release(victims)
            new_handles = await self._create(create) if create else []
        except BaseException:
            n.creating -= create
            n.held -= len(got)
            self._put_back(got)
            raise
        n.creating -= create
        now = time.monotonic()
        for pid, h in zip(self.page_ids.take(len(new_handles)), new_handles):
            page = Page(id=pid, device=self.uuid, handle=h, pooled_at=now)
            self.pages[pid] = page
            got.append(page)
        self.counters.created_total += len(new_handles)
        n.held += len(new_handles)
        return got

    def _handed(self, got: list[Page], session: "Session") -> list[Page]:
        """The pages of an Allocate, counted HELD already: now the session's."""
        for page in got:
            page.state = PageState.HELD
            page.session = session
            page.uid = session.uid
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
            k = min(CREATE_BATCH, count - len(made))
            fut = asyncio.ensure_future(self.worker.call(self.backend.create_pages, self.spec.ordinal, k, self.page_size, self.zero_pages))
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

    def _put_back(self, pages: list[Page]) -> None:
        """Undo ready.take (failure before anything was handed out)."""
        now = time.monotonic()
        for page in pages:
            self._pool(page, now)

    def _pool(self, page: Page, now: float) -> None:
        page.state = PageState.POOLED
        page.session = None
        page.pooled_at = now
        self.ready.put(page)
        self.counts.pooled += 1

    def _shortage_message(self, session: "Session", count: int) -> str:
        holders = self.holders()
        who = ", ".join(f"session {sid} '{name}' (uid {uid}) holds {format_size(k * self.page_size)}" for sid, name, uid, k in holders[:5])
        return (
            f"device {self.uuid}: cannot allocate {count} pages ({format_size(count * self.page_size)}) "
            f"for session {session.id} '{session.name}': budget {format_size(self.budget.bytes)}, "
            f"{self.counts.free} pages free, {self.ready.n} pooled, {self.counts.held} held by sessions"
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
    def give_back_now(self, pages: list[Page], keeper: "Session | None" = None, *, lend_again: bool = True) -> None:
        """Pages a session freed (or held when it ended), given back without
        waiting: they leave in_use at once. Pages nothing needs to zero
        (nobody wrote them, or --no-zero-pages) are pooled for their uid
        before this returns; the others go to the zeroer, which pools them
        once zeroed (in the background: nobody waits for it, and it finishes
        even if the client that freed them died). `keeper`: the session
        freed them with keep (it keeps their imported handles: keepers.py).
        lend_again False: the daemon is stopping and only releases them, so
        nobody gets them from it again and nothing is zeroed (their client
        may still map them, and resume them from a restarted daemon)."""
        if not pages:
            return
        if keeper is not None:
            self.keepers.keep(keeper, pages)
        if self.counts.standby:
            self.set_standby(pages, False)
        for page in pages:
            page.state = PageState.ZEROING
            page.session = None
        self.counts.held -= len(pages)
        self.counts.pooled += len(pages)
        dirty = self.backend.needs_zeroing([p.handle for p in pages]) if self.zero_pages and lend_again else ()
        if not dirty:
            self._pooled_now(pages)
            return
        if len(dirty) == len(pages):
            self.zeroer.add(pages)
            return
        ids = set(map(id, dirty))
        self._pooled_now([p for p in pages if id(p.handle) not in ids])
        self.zeroer.add([p for p in pages if id(p.handle) in ids])

    def set_standby(self, pages: list[Page], on: bool) -> int:
        """Held pages their session keeps mapped as standby (on), or uses
        again (off): still the session's either way. Returns pages changed."""
        n = 0
        for page in pages:
            if page.standby != on and page.session is not None:
                page.standby = on
                page.session.standby_by_device[self.uuid] += 1 if on else -1
                n += 1
        self.counts.standby += n if on else -n
        return n

    async def give_back(self, pages: list[Page]) -> None:
        """give_back_now, then wait until nothing waits for zeroing."""
        self.give_back_now(pages)
        await self.zeroer.idle()

    def _pooled_now(self, pages: list[Page]) -> None:
        now = time.monotonic()
        self.counts.pooled -= len(pages)
        for page in pages:
            self._pool(page, now)
        self._notify(len(pages))

    def _zeroed(self, pages: list[Page]) -> None:
        """The zeroer's batch is done: the pages are ready for their uid."""
        self._pooled_now(pages)

    async def _zero_failed(self, pages: list[Page], exc: Exception) -> None:
        log.error("device %s: zeroing %d pages failed (%s); releasing them", self.uuid, len(pages), exc)
        await self.keepers.release_ready(pages)  # counted pooled meanwhile
        self.counts.pooled -= len(pages)
        await self._release(pages)
        self._notify(0)

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
        """After an Allocate: refill the warm pool once its ready pages fell
        below half the warm target (then up to the whole target). Not at
        every page taken: with Allocates and Frees alternating, a refill at
        each dip made a page on the device worker that the Free's page,
        back from zeroing, then pushed over the target for trim_idle to
        release: a create and a release of driver work per pair, competing
        with requests on the worker, for a pool that stayed warm anyway."""
        if not self._no_refill and not self._refilling and self.ready.n * 2 < self.warm_pages and self.counts.free > 0:
            self._refilling = True
            asyncio.get_running_loop().create_task(self._refill())

    async def _refill(self) -> None:
        self._refilling = True
        n = self.counts
        try:
            while not self._no_refill:
                want = min(self.warm_pages - self.ready.n, n.free, CREATE_BATCH)
                if want <= 0:  # filled, or the rest of the budget is in use: nothing failed
                    self.fill_error = None
                    return
                n.pooled += want  # warm pages in the making are pooled, not in use
                try:
                    handles = await self.worker.call(self.backend.create_pages, self.spec.ordinal, want, self.page_size, self.zero_pages)
                except Exception as exc:
                    log.warning("device %s: warm page creation failed: %s", self.uuid, exc)
                    self.fill_error = str(exc) or type(exc).__name__
                    return
                finally:
                    n.pooled -= want
                now = time.monotonic()
                for pid, h in zip(self.page_ids.take(len(handles)), handles):
                    page = Page(id=pid, device=self.uuid, handle=h)
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
        excess = self.ready.n - self.warm_pages
        if excess <= 0:
            return 0
        victims = self.ready.take_idle(excess, now - self.idle_seconds)
        if victims:
            await self._release_pooled(victims)
        return len(victims)

    async def release_all_pooled(self) -> int:
        victims = self.ready.take_all()
        if victims:
            await self._release_pooled(victims)
        return len(victims)

    async def _release_pooled(self, victims: list[Page]) -> None:
        """Release pages taken out of the ready lists. Pages a client keeps a
        handle of are released in the background once their keepers let go
        (keepers.py): they stay counted as pooled meanwhile, since their
        memory is still there, so nobody may use their budget yet."""
        kept = [p for p in victims if p.keepers]
        rest = [p for p in victims if not p.keepers] if kept else victims
        if kept:
            task = asyncio.get_running_loop().create_task(self._release_kept(kept))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        if rest:
            self.counts.pooled -= len(rest)
            await self._release(rest)

    async def _release_kept(self, pages: list[Page]) -> None:
        try:
            await self.keepers.release_ready(pages)
        finally:
            self.counts.pooled -= len(pages)
            await self._release(pages)
            self._notify(0)  # an Allocate waiting for pooled pages to come: they went

    def release_everything_sync(self) -> None:
        """Shutdown: every page still known (pooled or held) is released."""
        handles = [p.handle for p in self.pages.values()]
        self.pages.clear()
        self.ready.take_all()
        self.counters.released_total += len(handles)
        self.counts.pooled = self.counts.held = 0
        if handles:
            self.worker.call_sync(self.backend.release_pages, self.spec.ordinal, handles)
