"""What carries sessions across a daemon restart (--state-dir).

- The journal (journal.py): every change of the sessions' books that a
  restarted daemon needs to check resume claims, written after the books
  made it and before the pages reach the client (`lent`). A write that
  fails marks the journal stale; it is rewritten whole when it can be.
- Orphans: the sessions of the previous daemon (`recover`), whose pages
  count as in use until their clients resume them (`resume`) or
  resume_grace passes (`expire`).
- The page store (keeper.py, --page-store keeper): a copy of each lent
  page's fd, put there before the client can hold the page, so that a
  resume needs no fd from the client.

Recovery is what the core (core/daemon.py) asks of recovery
(core/ledger.py's RecoveryPort). It gets the few things it uses, not the
core: the settings, the core's Ledger (the sessions, pools, ids and
tombstones it restores and books), the Identity that finds a resuming
client's channel, and `bind`, which makes a resumed session live.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import resource
import time
from typing import Callable, Iterable

from ... import errors
from ...fdchannel import close_fds
from ...config import ConfigError, Settings
from .journal import JournalDamaged, JournalTooNew, JSession, Journal
from .keeper import PageStore, StoreTooNew, StoreUnavailable, SystemdStore
from ..host import procs
from ..core.identity import Identity
from ..core.ledger import Ledger
from ..core.pool import DevicePool, Page
from ..core.sessions import Session

log = logging.getLogger("kvcached.daemon")

JOURNAL_RETRY_SECONDS = 2.0  # a journal that could not be written is rewritten this often until it can
STORE_RETRY_SECONDS = 2.0  # a keeper that went away is started again this often until it is


class Recovery:
    """The journal, the orphans and the page store of one Daemon."""

    def __init__(self, settings: Settings, ledger: Ledger, identity: Identity, bind: Callable[..., Session]):
        self.settings = settings
        self.books = ledger
        self.identity = identity
        self.bind = bind  # (port, id=, name=, ...) -> the live Session (core/daemon.py Daemon.bind)
        if not settings.state_dir:
            raise ValueError("Recovery needs a state dir (without one the core keeps core/ledger.py's NoRecovery)")
        self.journal = Journal(settings.state_dir)
        self.journaling = True  # an attribute the core reads on every loan, not a call (NoRecovery's is False)
        # sessions of a previous daemon, waiting for their clients to resume them
        self.orphans: dict[int, JSession] = {}
        self._orphan_deadline: dict[int, float] = {}
        self.store: PageStore | SystemdStore | None = None  # the page store (keeper.py), unless --page-store none
        self.stored: dict[int, int] = {}  # orphans' page id -> our copy of the store's fd, until resumed or forgotten
        self.journal_damage: dict | None = None  # set when recover() found the journal damaged
        self.journal_stale: str | None = None  # why the journal could not be written (then rewritten when it can)
        self._journal_retry = 0.0
        self._store_retry = 0.0  # when a lost keeper is next started again

    # ---- start-up -------------------------------------------------------
    def recover(self) -> None:
        """Read the journal a previous daemon left: its live sessions become
        orphans whose pages count as in use until their clients resume them
        (ResumeSession) or resume_grace passes. Then start a new journal."""
        j, books = self.journal, self.books
        try:
            j.load()
        except JournalTooNew as exc:  # not damage: nothing is moved or rewritten
            raise errors.FailedPrecondition(str(exc)) from None
        except JournalDamaged as exc:
            aside = j.move_aside()
            j.forget()
            self.journal_damage = {"path": str(exc.path), "line": exc.line, "problem": exc.problem, "moved_to": str(aside)}
            log.error(
                "%s. Moved it to %s and starting WITHOUT resumes: the sessions of the previous daemon cannot be "
                "resumed (their clients see them end and open new ones); memory their clients still map is "
                "unavailable, not free, until they let it go (the budget follows the device's free memory). "
                "Nothing else to do: keep %s for a bug report, then delete it (docs/reliability.md).",
                exc, aside, aside.name)
        books.next_session_id = j.next_session_id
        books.page_ids.continue_from(j.next_page_id)
        for js in j.sessions.values():
            for pid, (dev, _) in list(js.pages.items()):
                pool = books.pools.get(dev)
                if pool is None:
                    log.warning("journal: session %d page %d is on device %s, which this daemon does not serve; forgotten", js.sid, pid, dev)
                    del js.pages[pid]
                    continue
                pool.hold_orphans(1)
            self.orphans[js.sid] = js
            self._orphan_deadline[js.sid] = self._grace_end(js)
        self._open_store()  # before the journal is rewritten: a store this daemon cannot read stops it here
        j.start(self.orphans, j.next_session_id, j.next_page_id)
        self._forget_dead_clients(j.scope)
        if self.orphans:
            wait = max(self._orphan_deadline.values()) - time.monotonic()
            log.info(
                "journal: %d session(s) of the previous daemon (%d pages) wait up to %.3gs for their clients to resume them",
                len(self.orphans), sum(len(js.pages) for js in self.orphans.values()), max(wait, 0.0),
            )

    def _grace_end(self, js: JSession) -> float:
        """When orphan `js` is forgotten (time.monotonic()): resume_grace
        after the first restart that made it an orphan. A later restart
        keeps that end (journaled as `orphan_until`), so restarts closer
        together than the grace cannot keep an orphan alive forever; it
        never lies beyond one grace from now (a wall clock set back)."""
        now = time.time()
        until = now + self.settings.resume_grace
        if js.orphan_until > 0:
            until = min(until, js.orphan_until / 1000)
        js.orphan_until = int(until * 1000)
        return time.monotonic() + max(until - now, 0.0)

    def _forget_dead_clients(self, scope: str) -> None:
        """Orphans whose client process is gone (procs.gone: its pid and
        start time were journaled in this pid namespace and boot) are
        forgotten now: nobody can resume them."""
        for sid, js in list(self.orphans.items()):
            if procs.gone(js.pid, js.pstart, scope):
                self.forget_orphan(sid, f"its client (pid {js.pid}) is gone")

    def _open_store(self) -> None:
        """With a state dir: open the page store (systemd's fd store under a
        unit that has one, else the keeper of the state dir, which is
        started if none serves) and take what it holds: the fds of the
        orphans' pages. Pages the journal does not name leave the store;
        pages it names that the store lacks can only be resumed by the fds
        their clients re-send."""
        kind = self.settings.page_store
        if kind == "none":
            return
        if kind == "auto":
            kind = "systemd" if SystemdStore.wanted() else "keeper"
        pages = sum(p.budget.pages for p in self.books.pools.values())
        try:
            if kind == "systemd":
                self.store = SystemdStore.from_env()
                self._check_systemd_capacity(self.store, pages)
            else:
                self.store = PageStore.open(self.settings.state_dir, self.settings.resume_grace + 30)
                self._check_keeper_capacity(pages)
        except StoreUnavailable as exc:
            log.error("page store: %s; resumes are checked by the fds clients re-send (docs/cuda.md, \"Page identity\")", exc)
            return
        try:
            held = self.store.take_all()
        except StoreTooNew as exc:  # a newer daemon's store: refuse to start, take nothing
            self.store.close()
            self.store = None
            raise errors.FailedPrecondition(str(exc)) from None
        named = {pid for js in self.orphans.values() for pid in js.pages}
        extra = [pid for pid in held if pid not in named]
        if extra:
            log.warning("page store: %d page(s) the journal does not name (a session that ended as the daemon died): "
                        "given back", len(extra))
            self.store.drop(extra)
            for pid in extra:
                os.close(held.pop(pid))
        self.stored = held
        missing = len(named) - len(held)
        if named:
            log.info("page store: %d of the %d pages of the previous daemon's sessions are in the store%s", len(held), len(named),
                     f"; {missing} are not (the store was restarted or gone, or was full): those resume only by the fds their clients "
                     "re-send" if missing else "")

    @staticmethod
    def _check_keeper_capacity(pages: int) -> None:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        if pages + 64 > hard:  # the keeper raises its soft limit to this hard one: one fd per lent page
            log.warning("page store: the budget is %d pages but a keeper may hold at most ~%d fds (RLIMIT_NOFILE hard "
                        "limit %d): pages lent beyond that are not kept, so their sessions resume only by the fds "
                        "their clients re-send; raise LimitNOFILE (systemd) or the hard ulimit -n, or use larger pages",
                        pages, hard - 64, hard)

    def _check_systemd_capacity(self, store: SystemdStore, pages: int) -> None:
        """Say what the budget needs of FileDescriptorStoreMax=; a store too
        small for --prealloc is a configuration error (exit 2)."""
        cap = store.capacity
        if cap is None:
            log.warning("page store: systemd's fd store (NOTIFY_SOCKET %s); systemd did not say its size ($FDSTORE, "
                        "systemd 254+): set FileDescriptorStoreMax= to at least the budget's %d pages", store.path, pages)
            return
        prealloc = sum(-(-self.settings.prealloc_bytes // p.page_size) for p in self.books.pools.values())
        if cap < prealloc:
            raise ConfigError(
                f"page_store: systemd's fd store holds {cap} fds (FileDescriptorStoreMax=) but --prealloc makes "
                f"{prealloc} pages ready to lend: raise FileDescriptorStoreMax= to the budget's {pages} pages")
        log.info("page store: systemd's fd store (FileDescriptorStoreMax=%d) for a budget of %d pages%s", cap, pages,
                 "" if cap >= pages else f": pages lent beyond {cap} are not kept (their sessions resume only by the "
                 "fds their clients re-send); raise FileDescriptorStoreMax= to the budget's pages")

    # ---- the books' changes ----------------------------------------------
    def record(self, rec: dict) -> None:
        """Journal a change the books already made. A write that fails (a
        full or read-only state dir) never undoes or skips the change: the
        journal is marked stale instead (stale_journal), its file removed so
        that no later daemon resumes from what it no longer matches, and
        rewritten whole from the live books when a write works again."""
        j = self.journal
        if self.journal_stale is not None:
            return
        try:
            j.append(rec)
            live = sum(len(s.pages) + 1 for s in self.books.sessions.values()) + sum(len(o.pages) + 1 for o in self.orphans.values())
            if j.wants_compaction(live):
                j.compact(self._live_state(), self.books.next_session_id, self.books.page_ids.peek())
        except OSError as exc:
            self._journal_failed(exc)

    def lent(self, s: Session, pool: DevicePool, pages: list[Page], fds: list[int]) -> None:
        """Pages booked to `s`, before they are delivered (DevicePool.lend
        calls it): journaled with their identities, and put in the page
        store before the client can hold them."""
        be = pool.backend
        for p, fd in zip(pages, fds):
            if not p.ident:  # a page's identity is the same for every fd of it (Backend.identity): once
                p.ident = be.identity(fd)
        self.record({"op": "alloc", "sid": s.id, "dev": pool.uuid, "pages": [[p.id, p.ident] for p in pages]})
        if self.store is not None:  # in the store before the client can hold it
            self.store.put([p.id for p in pages], fds)

    def returned(self, s: Session, pages: list[Page]) -> None:
        """Pages `s` no longer holds (freed, or a loan undone)."""
        self.record({"op": "free", "sid": s.id, "pages": [p.id for p in pages]})
        self._unstore(p.id for p in pages)

    def ended(self, s: Session) -> None:
        """`s` ended: nothing of it is left to resume."""
        self.record({"op": "close", "sid": s.id})
        self._unstore(s.pages)

    def _unstore(self, page_ids: Iterable[int]) -> None:
        """Pages that no session holds any more leave the store (and an
        orphan's copy of their fd is closed: the driver frees a page nobody maps)."""
        if self.store is None:
            return
        ids = list(page_ids)
        self.store.drop(ids)
        for pid in ids:
            fd = self.stored.pop(pid, None)
            if fd is not None:
                os.close(fd)

    def _journal_failed(self, exc: OSError) -> None:
        self.journal_stale = f"{exc.strerror or exc} ({self.journal.path})"
        self._journal_retry = time.monotonic() + JOURNAL_RETRY_SECONDS
        removed = self.journal.abandon()
        log.error("journal: writing %s failed: %s. The daemon's books stay right and it keeps serving, but sessions "
                  "cannot be resumed after a restart until the journal is written again (%s; retried every %gs).",
                  self.journal.path, exc.strerror or exc,
                  "the stale file was removed" if removed else "the stale file could not be removed: " + str(self.journal.path),
                  JOURNAL_RETRY_SECONDS)

    def _live_state(self) -> dict[int, JSession]:
        out = dict(self.orphans)
        for s in self.books.sessions.values():
            out[s.id] = JSession(
                s.id, s.uid, s.name, s.resume_hash, s.guaranteed_bytes, s.max_bytes, s.priority, s.labels,
                {p.id: (p.device, p.ident) for p in s.pages.values()}, pid=s.pid if s.pstart else 0, pstart=s.pstart,
            )
        return out

    # ---- housekeeping -----------------------------------------------------
    def expire(self, now: float) -> None:
        """Forget the orphans whose resume_grace is over (housekeeping)."""
        for sid in [k for k, t in self._orphan_deadline.items() if t <= now]:
            self.forget_orphan(sid, f"not resumed within {self.settings.resume_grace:g} s of the restart that orphaned it")

    def rewrite_stale_journal(self, now: float) -> None:
        """A stale journal is rewritten whole from the live books, every
        JOURNAL_RETRY_SECONDS until a write works (housekeeping)."""
        if self.journal_stale is None or now < self._journal_retry:
            return
        try:
            self.journal.compact(self._live_state(), self.books.next_session_id, self.books.page_ids.peek())
        except OSError as exc:
            self.journal.abandon()
            self._journal_retry = now + JOURNAL_RETRY_SECONDS
            log.debug("journal: still cannot write %s: %s", self.journal.path, exc)
            return
        log.warning("journal: %s written again (%d sessions); sessions are resumable after a restart again "
                    "(it had failed: %s)", self.journal.path, len(self.books.sessions) + len(self.orphans), self.journal_stale)
        self.journal_stale = None

    async def restore_store(self, now: float) -> None:
        """A keeper that went away while the daemon runs is started again
        (every STORE_RETRY_SECONDS until it is, housekeeping), and every page
        lent now is put in it, so that a restart after that resumes them
        too. systemd's store is not restarted: it is systemd's."""
        st = self.store
        if not isinstance(st, PageStore) or st.check() or now < self._store_retry:
            return
        self._store_retry = now + STORE_RETRY_SECONDS
        try:
            new = await asyncio.to_thread(PageStore.open, self.settings.state_dir, self.settings.resume_grace + 30)
        except StoreUnavailable as exc:
            log.error("page store: cannot start a new keeper (%s); retrying in %g s", exc, STORE_RETRY_SECONDS)
            return
        # the new keeper takes every put and drop from now on, so a page lent
        # or freed during the refill below lands there too (a page freed
        # meanwhile may be put again: a restart drops what the journal does
        # not name)
        self.store = new
        put = 0
        try:
            for s in list(self.books.sessions.values()):
                by_pool: dict[str, list[Page]] = {}
                for p in list(s.pages.values()):
                    by_pool.setdefault(p.device, []).append(p)
                for dev, pages in by_pool.items():
                    pool = self.books.pools[dev]
                    fds, owned = await pool.export_fds(pages)
                    try:
                        new.put([p.id for p in pages], fds)
                    finally:
                        close_fds(owned)  # made for this put: ours to close
                    put += len(pages)
            if self.stored:  # orphans' pages, still waiting for their clients
                new.put(list(self.stored), list(self.stored.values()))
                put += len(self.stored)
        except Exception as exc:  # a keeper half filled is no store to resume from: start over later
            log.error("page store: refilling the new keeper failed (%s); retrying in %g s", exc, STORE_RETRY_SECONDS)
            new.clear()
            new.close()
            return
        if new.available:
            log.warning("page store: a new keeper holds the %d pages lent now (the previous one went away); a restart "
                        "resumes them from it again", put)

    def forget_orphan(self, sid: int, reason: str) -> None:
        js = self.orphans.pop(sid)
        self._orphan_deadline.pop(sid, None)
        per_dev: dict[str, int] = {}
        for dev, _ in js.pages.values():
            per_dev[dev] = per_dev.get(dev, 0) + 1
        for dev, n in per_dev.items():
            self.books.pools[dev].forget_orphans(n)
        self.record({"op": "close", "sid": sid})
        self._unstore(js.pages)
        self.books.tombstones.add(sid, reason)
        log.warning("session %d '%s' (uid %d): %s; forgetting its %d pages (their memory stays with whoever still maps them)",
                    sid, js.name, js.uid, reason, len(js.pages))

    # ---- resume -----------------------------------------------------------
    def may_adopt(self, session_id: int, uid: int, page_id: int) -> bool:
        """Whether an ADOPT record's page is worth keeping until
        ResumeSession: a page the journal gave an orphan of that uid (so
        nobody can make the daemon hold descriptors for nothing)."""
        js = self.orphans.get(session_id)
        return js is not None and js.uid == uid and page_id in js.pages

    async def resume(self, caller_uid: int | None, secret: bytes, sid: int, token: bytes, page_ids: list[int]) -> tuple[Session, int, int]:
        """Re-attach a session of the previous daemon to a new fd channel,
        adopting the pages its client re-sent (ADOPT, collected by the
        channel adapter) after checking the claim against the journal.
        Returns (session, adopted, forgotten)."""
        port = self.identity.port(caller_uid, secret, "ResumeSession")
        adoption = self.identity.directory().adoption(port)
        js = self._orphan_claimed(sid, token, port.uid)
        resent = self._check_pages(js, page_ids, adoption)
        await self._check_resent_fds(js, resent, adoption)
        imported = await self._import(js, page_ids, adoption)
        if sid not in self.orphans or port.closed:  # lost a race with the grace timer or the client
            await self._release(imported)
            raise errors.FailedPrecondition(f"session {sid} could not be resumed: it expired or its channel closed meanwhile")
        s, adopted, forgotten = self._adopt(js, port, imported)
        self.books.count("sessions_resumed")
        log.info("session %d '%s' resumed by pid %d uid %d: %d pages adopted, %d forgotten",
                 sid, s.name, s.pid, s.uid, adopted, forgotten)
        return s, adopted, forgotten

    def _orphan_claimed(self, sid: int, token: bytes, uid: int) -> JSession:
        """The orphan a ResumeSession names, if its token and uid are its own."""
        js = self.orphans.get(sid)
        if js is None:
            if sid in self.books.sessions:
                raise errors.FailedPrecondition(f"session {sid} is live; only a session of a previous daemon can be resumed")
            reason = self.books.tombstones.get(sid)
            raise errors.NotFound(f"no session {sid} to resume" + (f" ({reason})" if reason else " in the journal"))
        if not hmac.compare_digest(hashlib.sha256(token).hexdigest(), js.resume_hash):
            raise errors.PermissionDenied(f"resume token does not match session {sid}")
        if uid != js.uid:
            raise errors.PermissionDenied(f"session {sid} belonged to uid {js.uid}, not to uid {uid}")
        return js

    def _check_pages(self, js: JSession, page_ids: list[int], adoption) -> list[int]:
        """The claimed pages are the orphan's, each once, and each not in the
        page store was re-sent as ADOPT on this channel. Returns those
        re-sent ones. Pages in the page store (keeper.py) are taken from
        there: the daemon's own fds, whatever the driver's fds look like."""
        sid = js.sid
        if len(set(page_ids)) != len(page_ids):
            raise errors.InvalidArgument("page_ids repeats a page; nothing was adopted")
        if adoption.fds and adoption.session_id != sid:
            raise errors.InvalidArgument(f"the ADOPT records on this channel name session {adoption.session_id}, not {sid}")
        resent = [pid for pid in page_ids if pid not in self.stored]
        for pid in page_ids:
            if pid not in js.pages:
                raise errors.PermissionDenied(f"page {pid} was not held by session {sid}; nothing was adopted")
        for pid in resent:
            if pid not in adoption.fds:
                raise errors.InvalidArgument(f"page {pid} is claimed but its fd was not sent as ADOPT; nothing was adopted")
        return resent

    async def _check_resent_fds(self, js: JSession, resent: list[int], adoption) -> None:
        """Each re-sent fd is the page the journal recorded. A re-sent fd
        proves a page only where fds identify pages: on a driver whose
        exports all share one fstat identity any page's fd would pass for
        any other's, so nothing is adopted there (and the orphan goes)."""
        pools, sid = self.books.pools, js.sid
        for dev in {js.pages[pid][0] for pid in resent}:
            if dev in pools and not await pools[dev].identities_distinct():
                if sid in self.orphans:
                    self.forget_orphan(sid, "not resumable: the driver's exported fds do not identify their pages")
                raise errors.FailedPrecondition(
                    f"session {sid} cannot be resumed with its pages: on device {dev} every exported page fd has the "
                    "same identity, so the daemon cannot tell which page a re-sent fd is; open a new session "
                    "(its old mappings keep their memory until unmapped)")
        for pid in resent:
            if pools[js.pages[pid][0]].backend.identity(adoption.fds[pid]) != js.pages[pid][1]:
                raise errors.PermissionDenied(f"the fd sent for page {pid} is not the page the journal recorded; nothing was adopted")

    async def _import(self, js: JSession, page_ids: list[int], adoption) -> dict[str, tuple[list[int], list]]:
        """A handle of every claimed page, per device (from the store's fd or
        the re-sent one); all or nothing: the orphan keeps its pages and the
        client may retry."""
        by_dev: dict[str, list[int]] = {}
        for pid in page_ids:
            by_dev.setdefault(js.pages[pid][0], []).append(pid)
        imported: dict[str, tuple[list[int], list]] = {}
        try:
            for dev, pids in by_dev.items():
                fds = [self.stored.pop(pid) if pid in self.stored else adoption.take(pid) for pid in pids]
                handles = await self.books.pools[dev].import_pages(fds)  # the backend takes the fds
                imported[dev] = (pids, handles)
        except BaseException:
            await self._release(imported)  # undo earlier devices
            raise
        adoption.discard()
        return imported

    async def _release(self, imported: dict[str, tuple[list[int], list]]) -> None:
        for dev, (_, handles) in imported.items():
            await self.books.pools[dev].release_handles(handles)

    def _adopt(self, js: JSession, port, imported: dict[str, tuple[list[int], list]]) -> tuple[Session, int, int]:
        """The orphan becomes a live session on `port` with the imported
        pages; the pages it no longer claims are forgotten (journaled)."""
        sid, books = js.sid, self.books
        del self.orphans[sid]
        self._orphan_deadline.pop(sid, None)
        s = self.bind(port, id=sid, name=js.name, labels=dict(js.labels), guaranteed_bytes=js.guaranteed_bytes,
                      max_bytes=js.max_bytes, priority=js.priority, resume_hash=js.resume_hash)
        adopted = {pid for pids, _ in imported.values() for pid in pids}
        forgotten = [pid for pid in js.pages if pid not in adopted]
        per_dev: dict[str, int] = {}
        for pid in forgotten:
            per_dev[js.pages[pid][0]] = per_dev.get(js.pages[pid][0], 0) + 1
        for dev, n in per_dev.items():
            books.pools[dev].forget_orphans(n)
        for dev, (pids, handles) in imported.items():
            pages = books.pools[dev].adopt(s, [(pid, h, js.pages[pid][1]) for pid, h in zip(pids, handles)])
            s.add_pages(pages)
        self.record({"op": "resume", "sid": sid} | ({"pid": s.pid, "ps": s.pstart} if s.pstart else {}))
        if forgotten:
            self.record({"op": "free", "sid": sid, "pages": forgotten})
            self._unstore(forgotten)
        return s, len(adopted), len(forgotten)

    # ---- shutdown -----------------------------------------------------------
    def close(self, keep: bool = False) -> None:
        """The daemon stops. keep: the sessions outlive the stop, so the
        journal stays as written and the page store keeps every page (the
        keeper outlives the daemon; systemd keeps its store across a
        restart with FileDescriptorStorePreserve=restart); the next start
        resumes them. Else every session ended: nothing is left to resume
        (the journal is removed) nor to keep (the keeper exits once alone
        with an empty store). Orphans not resumed yet are kept either way
        while the journal is up to date."""
        keep = keep or (bool(self.orphans) and self.journal_stale is None)
        self.journal.close(remove=not keep)
        if self.store is not None:
            if not keep:
                self.store.clear()
            self.store.close()
            for fd in self.stored.values():
                os.close(fd)
            self.stored.clear()
