"""The daemon's core: pools, sessions, their limits, resume, the life cycle.

No transport here. Two adapters sit beside it and translate:
- service.py, gRPC: protobuf in, Daemon calls, protobuf out;
- channel.py, the fd channel: records in, Daemon calls, records out. It
  also gives every session its SessionPort (deliver pages, hang up) and
  finds unbound channels for OpenSession/ResumeSession (PortDirectory).

Who asks is a `Who`: a Session the fd channel vouches for (the kernel named
the sender), or a `Bearer` (id, token) from gRPC. Mutating requests from a
Bearer are refused unless the daemon runs with --grpc-page-ops.

The core operations both adapters call (Allocate, Free, CloseSession) are
observed once, here, at their boundary (`_Observation`): `observers` get
(operation, code, seconds, waited) for each; the metrics subscribe.

Everything runs on one event loop (the gRPC aio server's; uvloop by
default). fd channel requests run at once in the adapter's read callback
and become Tasks only when they must wait (eager.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import logging
import os
import resource
import secrets
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple, Union

from .. import errors
from ..backends.base import Backend
from ..config import Settings, format_size
from ..errors import Code
from . import eager
from .admission import admit
from .elastic import Reclaim, Reclaimer, pending_pages
from .journal import JournalDamaged, JSession, Journal
from .keeper import PageStore, StoreUnavailable
from .pool import DevicePool, Page, PageIds, PageState, Shortage
from .sessions import DeliveryFailed, PortDirectory, Session, SessionPort, Tombstones, check_labels, check_name
from .worker import DeviceWorker

log = logging.getLogger("kvcached.daemon")

API_VERSION = 1
SECRET_SIZE = 32  # the fd channel's HELLO secret, the session token, the resume token
JOURNAL_RETRY_SECONDS = 2.0  # a journal that could not be written is rewritten this often until it can
# Operations observed by the core itself (both adapters reach them); the
# gRPC interceptor observes every other rpc.
CORE_OPS = frozenset({"Allocate", "Free", "CloseSession"})


@dataclass
class Event:
    """A Watch event before it becomes a protobuf (service.py converts)."""

    kind: str  # READY | RECLAIM | BUDGET_CHANGED | MEMORY_AVAILABLE | SHUTDOWN
    time_unix: float
    data: dict


@dataclass(frozen=True)
class Bearer:
    """A SessionRef as gRPC carries it, and the uid of the caller as the
    kernel named it to the control socket's front door (None: a trusted
    caller that reached grpcio directly, i.e. the daemon's own uid or
    root). A SessionRef is good only for the uid that opened the session."""

    id: int
    token: bytes
    uid: int | None = None


Who = Union[Session, Bearer]


class Allocated(NamedTuple):
    """The answer to an Allocate, before an adapter encodes it (a NamedTuple:
    made on every Allocate, and a frozen dataclass costs more to build)."""

    allocation_id: int
    device: str
    page_size: int
    page_ids: list[int]
    held_bytes: int


class Daemon:
    def __init__(self, settings: Settings, backend: Backend):
        self.settings = settings
        self.backend = backend
        self.pools: dict[str, DevicePool] = {}
        self.workers: list[DeviceWorker] = []
        self.sessions: dict[int, Session] = {}
        self.ports: PortDirectory | None = None  # the fd channel adapter, once attached
        self.tombstones = Tombstones()
        self.page_ids = PageIds()
        self._alloc_ids = itertools.count(1)
        self.started_monotonic = time.monotonic()
        self.shutting_down = False
        self._tasks: set[asyncio.Task] = set()
        # Observers (metrics, the elasticity manager) may hook these.
        self.on_session_end: list[Callable[[Session, str], None]] = []
        # (operation, Code, seconds, waited) once per core operation (CORE_OPS)
        self.observers: list[Callable[[str, Code, float, bool], None]] = []
        self.counters = {"sessions_opened": 0, "sessions_closed": 0, "sessions_crashed": 0, "fd_channel_errors": 0}
        self.reclaimer = Reclaimer(lambda: list(self.sessions.values()), self._post, settings.reclaim_timeout_ms / 1000)
        # (session, pool uuid, pages): tell the session when that many pages could be had
        self._notify: list[tuple[Session, str, int]] = []
        self.journal: Journal | None = Journal(settings.state_dir) if settings.state_dir else None
        # sessions of a previous daemon, waiting for their clients to resume them
        self.orphans: dict[int, JSession] = {}
        self._orphan_deadline: dict[int, float] = {}
        self._next_session_id = 1
        self._supply_read = 0.0  # when the devices' free memory was last read (monotonic)
        self.store: PageStore | None = None  # the page store (keeper.py), with --page-store keeper
        self.stored: dict[int, int] = {}  # orphans' page id -> our copy of the store's fd, until resumed or forgotten
        self.journal_damage: dict | None = None  # set when recover() found the journal damaged
        self.journal_stale: str | None = None  # why the journal could not be written (then rewritten when it can)
        self._journal_retry = 0.0

    # ---- start-up -------------------------------------------------------
    def start_devices(self) -> None:
        page_size = self.settings.page_size_bytes
        limit = self.settings.memory_limit_value
        for spec in self.backend.devices():
            if page_size % spec.granularity:
                raise errors.InvalidArgument(
                    f"page_size {page_size} is not a multiple of device {spec.uuid}'s granularity {spec.granularity}"
                )
            budget = limit.resolve(spec.total_bytes)
            if budget < page_size:
                raise errors.InvalidArgument(
                    f"memory_limit {limit} gives device {spec.uuid} a budget of {budget} bytes, less than one page ({page_size})"
                )
            worker = DeviceWorker(self.backend, spec.ordinal, spec.uuid[:12])
            worker.start()
            self.workers.append(worker)
            pool = DevicePool(
                self.backend,
                spec,
                worker,
                page_ids=self.page_ids,
                page_size=page_size,
                budget_bytes=budget,
                warm_pages=self.settings.prealloc_bytes // page_size,
                idle_seconds=self.settings.pool_idle_seconds,
                zero_pages=self.settings.zero_pages,
            )
            pool.on_pages_returned = self._pages_returned
            self.pools[spec.uuid] = pool
            log.info(
                "device %s (%s): budget %s of %s, page %s, warm pages %d",
                spec.uuid,
                spec.name,
                format_size(pool.budget.bytes),
                format_size(spec.total_bytes),
                format_size(page_size),
                pool.warm_pages,
            )
            free, _ = worker.call_sync(self.backend.memory_info, spec.ordinal)
            self._supply(pool, free)

    def _supply(self, pool: DevicePool, device_free: int) -> None:
        """Cap the pool's budget at what the device really has (pool.set_supply),
        saying so when the cap starts, changes by a lot, or ends."""
        before_capped = pool.budget_pages < pool.limit_pages
        changed = pool.set_supply(device_free)
        if changed is None:
            return
        old, new = changed
        capped = new < pool.limit_pages
        unavailable = format_size((pool.limit_pages - new) * pool.page_size) if capped else "0"
        if capped and (not before_capped or abs(new - old) * 20 >= pool.limit_pages):
            log.warning(
                "device %s: budget %s, not the configured %s: the device has only %s free besides the daemon's %d pages "
                "(%s unavailable: other processes' memory, or pages of a previous daemon its clients still map)",
                pool.uuid, format_size(new * pool.page_size), format_size(pool.limit_pages * pool.page_size),
                format_size(device_free), pool.n_pooled + pool.n_in_use, unavailable)
        elif before_capped and not capped:
            log.info("device %s: budget back to the configured %s (the device has the memory again)",
                     pool.uuid, format_size(new * pool.page_size))
        else:
            log.debug("device %s: budget %d -> %d pages (device free %d bytes)", pool.uuid, old, new, device_free)

    async def refresh_supply(self, pools: list[DevicePool] | None = None) -> None:
        """Read the devices' free memory (on their workers) and cap budgets."""
        self._supply_read = time.monotonic()
        for pool in pools if pools is not None else list(self.pools.values()):
            try:
                free, _ = await pool.worker.call(self.backend.memory_info, pool.spec.ordinal)
            except Exception as exc:  # noqa: BLE001 - keep the last budget
                log.debug("device %s: free memory unknown (%s); budget unchanged", pool.uuid, exc)
                continue
            self._supply(pool, free)

    def attach(self, ports: PortDirectory) -> None:
        """The fd channel adapter: where sessions' channels come from."""
        self.ports = ports

    def recover(self) -> None:
        """Read the journal a previous daemon left: its live sessions become
        orphans whose pages count as in use until their clients resume them
        (ResumeSession) or resume_grace passes. Then start a new journal."""
        if self.journal is None:
            return
        j = self.journal
        try:
            j.load()
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
        self._next_session_id = j.next_session_id
        self.page_ids.continue_from(j.next_page_id)
        deadline = time.monotonic() + self.settings.resume_grace
        for js in j.sessions.values():
            for pid, (dev, _) in list(js.pages.items()):
                pool = self.pools.get(dev)
                if pool is None:
                    log.warning("journal: session %d page %d is on device %s, which this daemon does not serve; forgotten", js.sid, pid, dev)
                    del js.pages[pid]
                    continue
                pool.hold_orphans(1)
            self.orphans[js.sid] = js
            self._orphan_deadline[js.sid] = deadline
        j.start(self.orphans, j.next_session_id, j.next_page_id)
        self._open_store()
        if self.orphans:
            log.info(
                "journal: %d session(s) of the previous daemon (%d pages) wait %gs for their clients to resume them",
                len(self.orphans), sum(len(js.pages) for js in self.orphans.values()), self.settings.resume_grace,
            )

    def _open_store(self) -> None:
        """--page-store keeper: connect to (or start) the keeper of the state
        dir and take what it holds: the fds of the orphans' pages. Pages the
        journal does not name leave the store; pages it names that the store
        lacks can only be resumed by the fds their clients re-send."""
        if self.settings.page_store != "keeper" or self.journal is None:
            return
        try:
            self.store = PageStore.open(self.settings.state_dir, self.settings.resume_grace + 30)
        except StoreUnavailable as exc:
            log.error("page store: %s; resumes are checked by the fds clients re-send (docs/cuda.md, \"Page identity\")", exc)
            return
        pages = sum(p.budget.pages for p in self.pools.values())
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        if pages + 64 > hard:  # the keeper raises its soft limit to this hard one: one fd per lent page
            log.warning("page store: the budget is %d pages but a keeper may hold at most ~%d fds (RLIMIT_NOFILE hard "
                        "limit %d): pages lent beyond that are not kept, so their sessions resume only by the fds "
                        "their clients re-send; raise LimitNOFILE (systemd) or the hard ulimit -n, or use larger pages",
                        pages, hard - 64, hard)
        held = self.store.take_all()
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
                     f"; {missing} are not (the keeper was restarted or gone): those resume only by the fds their clients "
                     "re-send" if missing else "")

    def _unstore(self, page_ids) -> None:
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

    def _journal(self, rec: dict) -> None:
        """Journal a change the books already made. A write that fails (a
        full or read-only state dir) never undoes or skips the change: the
        journal is marked stale instead (stale_journal), its file removed so
        that no later daemon resumes from what it no longer matches, and
        rewritten whole from the live books when a write works again."""
        j = self.journal
        if j is None or self.journal_stale is not None:
            return
        try:
            j.append(rec)
            live = sum(len(s.pages) + 1 for s in self.sessions.values()) + sum(len(o.pages) + 1 for o in self.orphans.values())
            if j.wants_compaction(live):
                j.compact(self._live_state(), self._next_session_id, self.page_ids.peek())
        except OSError as exc:
            self._journal_failed(exc)

    def _journal_failed(self, exc: OSError) -> None:
        self.journal_stale = f"{exc.strerror or exc} ({self.journal.path})"
        self._journal_retry = time.monotonic() + JOURNAL_RETRY_SECONDS
        removed = self.journal.abandon()
        log.error("journal: writing %s failed: %s. The daemon's books stay right and it keeps serving, but sessions "
                  "cannot be resumed after a restart until the journal is written again (%s; retried every %gs).",
                  self.journal.path, exc.strerror or exc,
                  "the stale file was removed" if removed else "the stale file could not be removed: " + str(self.journal.path),
                  JOURNAL_RETRY_SECONDS)

    def _rewrite_stale_journal(self, now: float) -> None:
        if self.journal_stale is None or now < self._journal_retry:
            return
        try:
            self.journal.compact(self._live_state(), self._next_session_id, self.page_ids.peek())
        except OSError as exc:
            self.journal.abandon()
            self._journal_retry = now + JOURNAL_RETRY_SECONDS
            log.debug("journal: still cannot write %s: %s", self.journal.path, exc)
            return
        log.warning("journal: %s written again (%d sessions); sessions are resumable after a restart again "
                    "(it had failed: %s)", self.journal.path, len(self.sessions) + len(self.orphans), self.journal_stale)
        self.journal_stale = None

    def _live_state(self) -> dict[int, JSession]:
        out = dict(self.orphans)
        for s in self.sessions.values():
            out[s.id] = JSession(
                s.id, s.uid, s.name, s.resume_hash, s.guaranteed_bytes, s.max_bytes, s.priority, s.labels,
                {p.id: (p.device, p.ident) for p in s.pages.values()},
            )
        return out

    def _forget_orphan(self, sid: int, reason: str) -> None:
        js = self.orphans.pop(sid)
        self._orphan_deadline.pop(sid, None)
        per_dev: dict[str, int] = {}
        for dev, _ in js.pages.values():
            per_dev[dev] = per_dev.get(dev, 0) + 1
        for dev, n in per_dev.items():
            self.pools[dev].forget_orphans(n)
        self._journal({"op": "close", "sid": sid})
        self._unstore(js.pages)
        self.tombstones.add(sid, reason)
        log.warning("session %d '%s' (uid %d): %s; forgetting its %d pages (their memory stays with whoever still maps them)",
                    sid, js.name, js.uid, reason, len(js.pages))

    def may_adopt(self, session_id: int, uid: int, page_id: int) -> bool:
        """Whether an ADOPT record's page is worth keeping until
        ResumeSession: a page the journal gave an orphan of that uid (so
        nobody can make the daemon hold descriptors for nothing)."""
        js = self.orphans.get(session_id)
        return js is not None and js.uid == uid and page_id in js.pages

    async def prefill(self) -> None:
        await asyncio.gather(*(p.prefill() for p in self.pools.values()))

    def start_background(self) -> None:
        self._spawn(self._housekeeping())

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _housekeeping(self) -> None:
        while not self.shutting_down:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            for pool in self.pools.values():
                try:
                    await pool.trim_idle(now)
                except Exception:  # keep the loop alive whatever happens
                    log.exception("idle trim failed on %s", pool.uuid)
            self._rewrite_stale_journal(now)
            poll = self.settings.memory_poll_seconds
            if poll > 0 and now - self._supply_read >= poll:
                await self.refresh_supply()
            self.reclaimer.idle_scan(list(self.pools.values()), self.settings.idle_shrink_seconds)
            for sid in [k for k, t in self._orphan_deadline.items() if t <= now]:
                self._forget_orphan(sid, f"not resumed within {self.settings.resume_grace:g} s of the restart")

    def count(self, counter: str) -> None:
        """An event an adapter reports (e.g. fd_channel_errors)."""
        self.counters[counter] = self.counters.get(counter, 0) + 1

    # ---- who is asking --------------------------------------------------
    def resolve(self, who: Who, op: str, mutating: bool = True) -> Session:
        """The session a request acts for. A Session comes vouched by its fd
        channel; a Bearer is checked (token) and, for requests that change
        pages, refused unless grpc_page_ops."""
        if isinstance(who, Session):
            if who.closed:
                raise errors.FailedPrecondition(f"session {who.id} is closed")
            return who
        if mutating and self.settings.page_ops_on_channel_only:
            # refused whatever the SessionRef; but never tell another uid more than PERMISSION_DENIED
            target = self.sessions.get(who.id)
            if target is not None:
                self._check_uid(who.uid, target)
            raise errors.FailedPrecondition(
                f"this daemon serves {op} only as a request on the session's fd channel, where the kernel vouches "
                "for the sender (channel_ops_only, the default; kvcached-serve --grpc-page-ops serves it over gRPC too); "
                "see docs/protocol.md"
            )
        return self.session(who.id, who.token, who.uid)


    def observe(self, op: str, code: Code, seconds: float, waited: bool = False) -> None:
        """Report one core operation to the observers. An adapter calls it
        itself only for a request of a core operation it had to refuse
        before reaching the core (a body it could not decode)."""
        for fn in self.observers:
            fn(op, code, seconds, waited)

    # ---- sessions -------------------------------------------------------
    def _ports(self) -> PortDirectory:
        if self.ports is None:
            raise errors.Unavailable("the fd channel is not serving yet")
        return self.ports

    @staticmethod
    def _check_uid(caller_uid: int | None, s: Session) -> None:
        """A SessionRef is good only for the uid that opened the session."""
        if caller_uid is not None and caller_uid != s.uid:
            who = f"the caller's ({caller_uid})" if caller_uid >= 0 else "a caller whose connection is gone"
            raise errors.PermissionDenied(
                f"session {s.id} belongs to another uid than {who}: a SessionRef is good only for the uid that opened the session")

    @staticmethod
    def _same_uid(caller_uid: int | None, port: SessionPort, rpc: str) -> None:
        """The session's identity is its fd channel's peer: the gRPC caller
        that binds it must be of the same uid."""
        if caller_uid is not None and caller_uid != port.uid:
            raise errors.PermissionDenied(
                f"{rpc} comes from uid {caller_uid}, but the fd channel of that secret belongs to uid {port.uid}: "
                "call it from the process (uid) that connected the channel")

    def _others_guaranteed(self, exclude: Session | None) -> int:
        return sum(s.guaranteed_bytes for s in self.sessions.values() if s is not exclude)

    def _budgets(self):
        return [p.budget for p in self.pools.values()]

    def open_session(
        self,
        caller_uid: int | None,
        secret: bytes,
        name: str,
        guaranteed_bytes: int,
        max_bytes: int,
        priority: int,
        labels: dict[str, str],
    ) -> Session:
        self._check_serving()
        check_name(name)
        labels = check_labels(labels)
        ports = self._ports()
        port = ports.find(secret)
        self._same_uid(caller_uid, port, "OpenSession")
        if len(self.sessions) >= self.settings.max_sessions:
            raise errors.ResourceExhausted(f"{len(self.sessions)} sessions open (max_sessions)")
        admit(self._budgets(), session=f"'{name}'", guaranteed_bytes=guaranteed_bytes, max_bytes=max_bytes,
              others_guaranteed=self._others_guaranteed(None))
        resume_token = secrets.token_bytes(SECRET_SIZE) if self.journal is not None else b""
        s = Session(
            id=self._next_session_id,
            token=secrets.token_bytes(SECRET_SIZE),
            name=name,
            port=port,
            admin=self.settings.is_admin(port.uid),
            labels=labels,
            guaranteed_bytes=guaranteed_bytes,
            max_bytes=max_bytes,
            priority=priority,
            resume_hash=hashlib.sha256(resume_token).hexdigest() if resume_token else "",
        )
        self._next_session_id += 1
        s.resume_token = resume_token  # handed to the client once, never stored
        ports.bind(port, s)
        self.sessions[s.id] = s
        self.counters["sessions_opened"] += 1
        self._journal({"op": "open", "sid": s.id, "uid": s.uid, "name": name, "rh": s.resume_hash,
                       "g": guaranteed_bytes, "m": max_bytes, "p": priority, "labels": labels})
        log.info("session %d '%s' opened by pid %d uid %d%s", s.id, name, s.pid, s.uid, " (admin)" if s.admin else "")
        return s

    async def resume_session(self, caller_uid: int | None, secret: bytes, sid: int, token: bytes, page_ids: list[int]) -> tuple[Session, int, int]:
        """Re-attach a session of the previous daemon to a new fd channel,
        adopting the pages its client re-sent (ADOPT, collected by the
        channel adapter) after checking the claim against the journal.
        Returns (session, adopted, forgotten)."""
        self._check_serving()
        if self.journal is None:
            raise errors.FailedPrecondition("this daemon keeps no journal (--state-dir), so sessions cannot be resumed; open a new one")
        ports = self._ports()
        port = ports.find(secret)
        self._same_uid(caller_uid, port, "ResumeSession")
        adoption = ports.adoption(port)
        js = self.orphans.get(sid)
        if js is None:
            if sid in self.sessions:
                raise errors.FailedPrecondition(f"session {sid} is live; only a session of a previous daemon can be resumed")
            reason = self.tombstones.get(sid)
            raise errors.NotFound(f"no session {sid} to resume" + (f" ({reason})" if reason else " in the journal"))
        if not hmac.compare_digest(hashlib.sha256(token).hexdigest(), js.resume_hash):
            raise errors.PermissionDenied(f"resume token does not match session {sid}")
        if port.uid != js.uid:
            raise errors.PermissionDenied(f"session {sid} belonged to uid {js.uid}, not to uid {port.uid}")
        if len(set(page_ids)) != len(page_ids):
            raise errors.InvalidArgument("page_ids repeats a page; nothing was adopted")
        if adoption.fds and adoption.session_id != sid:
            raise errors.InvalidArgument(f"the ADOPT records on this channel name session {adoption.session_id}, not {sid}")
        # Pages in the page store (keeper.py) are taken from there: the
        # daemon's own fds, whatever the driver's fds look like. Only the
        # others need the fd the client re-sent, checked by its identity.
        resent = [pid for pid in page_ids if pid not in self.stored]
        for pid in page_ids:
            if pid not in js.pages:
                raise errors.PermissionDenied(f"page {pid} was not held by session {sid}; nothing was adopted")
        for pid in resent:
            if pid not in adoption.fds:
                raise errors.InvalidArgument(f"page {pid} is claimed but its fd was not sent as ADOPT; nothing was adopted")
        by_dev: dict[str, list[int]] = {}
        for pid in page_ids:
            by_dev.setdefault(js.pages[pid][0], []).append(pid)
        # A re-sent fd proves a page only where fds identify pages: on a
        # driver whose exports all share one fstat identity any page's fd
        # would pass for any other's, so nothing is adopted there.
        for dev in {js.pages[pid][0] for pid in resent}:
            if dev in self.pools and not await self.pools[dev].identities_distinct():
                if sid in self.orphans:
                    self._forget_orphan(sid, "not resumable: the driver's exported fds do not identify their pages")
                raise errors.FailedPrecondition(
                    f"session {sid} cannot be resumed with its pages: on device {dev} every exported page fd has the "
                    "same identity, so the daemon cannot tell which page a re-sent fd is; open a new session "
                    "(its old mappings keep their memory until unmapped)")
        for pid in resent:
            if self.backend.identity(adoption.fds[pid]) != js.pages[pid][1]:
                raise errors.PermissionDenied(f"the fd sent for page {pid} is not the page the journal recorded; nothing was adopted")
        imported: dict[str, tuple[list[int], list]] = {}
        try:
            for dev, pids in by_dev.items():
                fds = [self.stored.pop(pid) if pid in self.stored else adoption.take(pid) for pid in pids]
                handles = await self.pools[dev].import_pages(fds)  # the backend takes the fds
                imported[dev] = (pids, handles)
        except BaseException:
            # undo earlier devices: the orphan keeps its pages, the client may retry
            for dev, (_, handles) in imported.items():
                await self.pools[dev].release_handles(handles)
            raise
        adoption.discard()
        if sid not in self.orphans or port.closed:  # lost a race with the grace timer or the client
            for dev, (_, handles) in imported.items():
                await self.pools[dev].release_handles(handles)
            raise errors.FailedPrecondition(f"session {sid} could not be resumed: it expired or its channel closed meanwhile")
        del self.orphans[sid]
        self._orphan_deadline.pop(sid, None)
        s = Session(
            id=sid, token=secrets.token_bytes(SECRET_SIZE), name=js.name, port=port, admin=self.settings.is_admin(port.uid),
            labels=dict(js.labels), guaranteed_bytes=js.guaranteed_bytes, max_bytes=js.max_bytes,
            priority=js.priority, resume_hash=js.resume_hash,
        )
        ports.bind(port, s)
        self.sessions[sid] = s
        adopted = {pid for pids, _ in imported.values() for pid in pids}
        forgotten = [pid for pid in js.pages if pid not in adopted]
        per_dev: dict[str, int] = {}
        for pid in forgotten:
            dev = js.pages[pid][0]
            per_dev[dev] = per_dev.get(dev, 0) + 1
        for dev, n in per_dev.items():
            self.pools[dev].forget_orphans(n)
        for dev, (pids, handles) in imported.items():
            pool = self.pools[dev]
            pages = pool.adopt(s, [(pid, h, js.pages[pid][1]) for pid, h in zip(pids, handles)])
            s.add_pages(pool, pages)
        if forgotten:
            self._journal({"op": "free", "sid": sid, "pages": forgotten})
            self._unstore(forgotten)
        self.count("sessions_resumed")
        log.info("session %d '%s' resumed by pid %d uid %d: %d pages adopted, %d forgotten",
                 sid, s.name, s.pid, s.uid, len(adopted), len(forgotten))
        return s, len(adopted), len(forgotten)

    def session(self, ref_id: int, token: bytes, caller_uid: int | None = None) -> Session:
        """The session a SessionRef names; checks the caller's uid (when the
        front door named it) and the token."""
        if not ref_id:
            raise errors.InvalidArgument("session is required (SessionRef with id and token)")
        s = self.target_session(ref_id)
        self._check_uid(caller_uid, s)
        if not hmac.compare_digest(s.token, token):
            raise errors.PermissionDenied(f"token does not match session {ref_id}")
        return s

    def admin_session(self, ref_id: int, token: bytes, caller_uid: int | None = None) -> Session:
        s = self.session(ref_id, token, caller_uid)
        if not s.admin:
            raise errors.PermissionDenied(f"session {s.id} (uid {s.uid}) is not an admin session (admin_uids)")
        return s

    def visible_sessions(self, s: Session) -> list[Session]:
        """The sessions GetStats shows to s: every session for an admin;
        otherwise s itself first, then the other sessions of the same uid.
        Same-uid visibility is safe: that uid can already ptrace, signal or
        read the memory of those processes; it is what lets Ollama (one uid)
        see its own llama-server children without being made an admin."""
        if s.admin:
            return list(self.sessions.values())
        return [s] + [x for x in self.sessions.values() if x.uid == s.uid and x is not s]

    def shrinker_session(self, ref_id: int, token: bytes, target_sid: int, caller_uid: int | None = None) -> Session:
        """The session a RequestShrink comes from: an admin, or a session of
        the target's own uid (asking one's own processes to give memory back
        needs no more than the uid already has)."""
        s = self.session(ref_id, token, caller_uid)
        if s.admin:
            return s
        target = self.target_session(target_sid)
        if target.uid != s.uid:
            raise errors.PermissionDenied(
                f"session {s.id} (uid {s.uid}) may only shrink sessions of its own uid "
                f"(session {target_sid} is uid {target.uid}) unless it is an admin session (admin_uids)")
        return s

    async def close_session(self, who: Who) -> int:
        """CloseSession: the session ends; returns the pages it gave back."""
        with _Observation(self, "CloseSession"):
            s = self.resolve(who, "CloseSession")
            return self.end_session(s, "closed by client")

    def session_lost(self, s: Session, crashed: bool) -> None:
        """The adapter lost the session's channel (EOF, peer exit)."""
        self.end_session(s, "client exited" if crashed else "fd channel closed", crashed=crashed)

    def end_session(self, s: Session, reason: str, *, crashed: bool = False,
                    farewell: errors.KVCachedError | None = None) -> int:
        """End a session: its pages go back to the pool (zeroed for their
        uid), its watchers stop, its port hangs up (GOODBYE, or ERROR with
        `farewell`). Returns pages returned."""
        if s.closed:
            return 0
        s.closed = True
        self.sessions.pop(s.id, None)
        self.tombstones.add(s.id, reason)
        self.counters["sessions_crashed" if crashed else "sessions_closed"] += 1
        if not self.shutting_down:
            self._journal({"op": "close", "sid": s.id})
            self._unstore(s.pages)
        by_pool: dict[str, list[Page]] = {}
        for page in s.pages.values():
            by_pool.setdefault(page.device, []).append(page)
        n = len(s.pages)
        for uuid, pages in by_pool.items():
            pool = self.pools[uuid]
            s.remove_pages(pool, pages)
            eager.start(pool.give_back(pages), self._tasks)
        for q in s.watchers:
            q.put_nowait(None)
        self.reclaimer.session_ended(s)
        s.port.hang_up(farewell, pages_returned=n)
        for hook in self.on_session_end:
            hook(s, reason)
        log.info("session %d '%s' ended (%s): %d pages returned", s.id, s.name, reason, n)
        return n

    # ---- pages ----------------------------------------------------------
    def pool(self, device: str) -> DevicePool:
        if not device:
            return next(iter(self.pools.values()))
        pool = self.pools.get(device)
        if pool is None:
            raise errors.NotFound(f"no device {device!r}; this daemon serves {', '.join(self.pools)}")
        return pool

    async def allocate(self, who: Who, device: str, count: int, wait: bool, wait_ms: int, notify: bool = False,
                       alloc_id: int | None = None) -> Allocated:
        """Allocate: admission, pages from the pool (waiting and reclaiming
        when allowed), delivery through the session's port, then the answer."""
        with _Observation(self, "Allocate", wait):
            s = self.resolve(who, "Allocate")
            self._check_serving()
            limit = self.settings.max_pages_per_request
            if count <= 0 or count > limit:
                raise errors.InvalidArgument(f"num_pages must be 1..{limit}, got {count}")
            pool = self.pool(device)
            admit([pool.budget], session=s, guaranteed_bytes=s.guaranteed_bytes, max_bytes=s.max_bytes,
                  device=pool.uuid, held_pages=s.held_pages(pool.uuid), more_pages=count)
            pages = await self._acquire(s, pool, count, wait, wait_ms, notify)
            if s.closed:
                # The session ended while its pages were being made: nobody got them.
                await pool.give_back(pages)
                raise errors.FailedPrecondition(f"session {s.id} closed while allocating")
            try:
                fds = pool.export_fds_now(pages)
                if fds is None:
                    fds = await pool.export_fds_on_worker(pages)
            except BaseException:
                eager.start(pool.give_back(pages), self._tasks)  # never the session's
                raise
            try:
                s.add_pages(pool, pages)
                if self.journal is not None:
                    fresh = self.backend.fresh_exports  # an export per delivery: its identity, not a kept one
                    for p, fd in zip(pages, fds):
                        if fresh or not p.ident:
                            p.ident = self.backend.identity(fd)
                    self._journal({"op": "alloc", "sid": s.id, "dev": pool.uuid, "pages": [[p.id, p.ident] for p in pages]})
                    if self.store is not None:  # in the store before the client can hold it
                        self.store.put([p.id for p in pages], fds)
                if alloc_id is None:
                    alloc_id = next(self._alloc_ids)
                await s.port.deliver(alloc_id, [p.id for p in pages], fds)
            except DeliveryFailed as exc:
                self.count("fd_channel_errors")
                err = errors.Unavailable(f"could not deliver pages on session {s.id}'s fd channel: {exc}")
                self.end_session(s, str(exc), farewell=err)
                raise err from None
            except asyncio.CancelledError:
                # The caller gave up (its deadline passed) before the answer: it
                # never learns these page ids, so the session must not keep them.
                if not s.closed and all(p.id in s.pages for p in pages):
                    s.remove_pages(pool, pages)
                    self._journal({"op": "free", "sid": s.id, "pages": [p.id for p in pages]})
                    self._unstore(p.id for p in pages)
                    self._spawn(pool.give_back(pages))
                raise
            finally:
                if self.backend.fresh_exports:  # sent (the client has its own now) or not: ours go
                    for fd in fds:
                        try:
                            os.close(fd)
                        except OSError:
                            pass
            pool.mark_held(pages)
            s.allocations_total += 1
            s.touch()
            return Allocated(alloc_id, pool.uuid, pool.page_size, [p.id for p in pages], s.held_pages(pool.uuid) * pool.page_size)

    async def _acquire(self, s: Session, pool: DevicePool, count: int, wait: bool, wait_ms: int, notify: bool) -> list[Page]:
        """pool.acquire, and when memory is short and the caller may wait:
        ask other sessions for pages (elastic.Reclaimer) and retry each time
        pages come back, until the deadline."""
        try:
            return await pool.acquire(s, count)  # the common case: no deadline, no bookkeeping
        except Shortage:
            pass
        loop = asyncio.get_running_loop()
        wait_s = (wait_ms or self.settings.default_wait_ms) / 1000
        deadline = loop.time() + wait_s
        asked: dict[int, tuple[Session, int, int]] = {}  # id -> (session, pages asked, held when first asked)
        while True:
            try:
                return await pool.acquire(s, count)
            except Shortage as short:
                if pool.budget_pages < pool.limit_pages and time.monotonic() - self._supply_read > 0.1:
                    # capped by what the device had: it may have more now (a client of a
                    # previous daemon exited); read it before refusing or reclaiming
                    before = pool.budget_pages
                    await self.refresh_supply([pool])
                    if pool.budget_pages > before:
                        continue
                now = loop.time()
                if not wait or now >= deadline:
                    pool.note_failure()
                    if notify:
                        self._notify.append((s, pool.uuid, count))
                    if not wait:
                        raise
                    raise errors.ResourceExhausted(self._waited_message(short, wait_s, pool, asked)) from None
                for victim, n in self.reclaimer.request(pool, s, short.missing, time.time() + (deadline - now)):
                    _, prev, held0 = asked.get(victim.id, (victim, 0, victim.held_pages(pool.uuid) + n))
                    asked[victim.id] = (victim, prev + n, held0 - n if prev == 0 else held0)
                await pool.wait_changed(min(deadline - now, 0.25))
                if s.closed:
                    raise errors.FailedPrecondition(f"session {s.id} closed while waiting for pages")

    @staticmethod
    def _waited_message(short: Shortage, waited: float, pool: DevicePool, asked: dict[int, tuple[Session, int, int]]) -> str:
        msg = f"after waiting {waited:g} s, still {short.missing} pages short: {short.message}"
        if not asked:
            return msg + "; no session had pages above its guarantee to ask for"
        parts = []
        for v, n, held0 in asked.values():
            given = max(0, held0 - v.held_pages(pool.uuid))
            state = "session ended" if v.closed else f"gave back {min(given, n)}"
            parts.append(f"session {v.id} '{v.name}' {n} pages ({state}{'; ignored requests before' if v.reclaim_ignored else ''})")
        return msg + "; asked to give back: " + ", ".join(parts)

    def _post(self, s: Session, kind: str, data: dict) -> None:
        s.post(Event(kind, time.time(), data))

    def _pages_returned(self, uuid: str, n: int) -> None:
        """Pages came back to a pool: tell sessions that asked to know."""
        if not self._notify:
            return
        pool = self.pools[uuid]
        keep = []
        for s, dev, want in self._notify:
            if s.closed:
                continue
            if dev == uuid and pool.available_for(s.uid) >= want:
                self._post(s, "MEMORY_AVAILABLE", {"device": uuid, "pages": pool.available_for(s.uid)})
            else:
                keep.append((s, dev, want))
        self._notify = keep

    async def free(self, who: Who, page_ids: list[int]) -> tuple[int, Session]:
        """Free: all or nothing. Returns (pages freed, the session)."""
        with _Observation(self, "Free"):
            s = self.resolve(who, "Free")
            if not page_ids:
                raise errors.InvalidArgument("page_ids is empty: name the pages to free")
            seen: set[int] = set()
            pages: list[Page] = []
            for pid in page_ids:
                if pid in seen:
                    raise errors.InvalidArgument(f"page {pid} appears more than once; nothing was freed")
                seen.add(pid)
                page = s.pages.get(pid)
                if page is None:
                    raise errors.NotFound(f"page {pid} is not held by session {s.id}; nothing was freed")
                if page.state is not PageState.HELD:
                    raise errors.FailedPrecondition(f"page {pid} is still being delivered; nothing was freed")
                pages.append(page)
            by_pool: dict[str, list[Page]] = {}
            for page in pages:
                by_pool.setdefault(page.device, []).append(page)
            for uuid, group in by_pool.items():
                s.remove_pages(self.pools[uuid], group)
                if s.asks:
                    self.reclaimer.settle(s, uuid, len(group))
            s.frees_total += 1
            s.touch()
            if self.journal is not None:
                self._journal({"op": "free", "sid": s.id, "pages": [p.id for p in pages]})
                self._unstore(p.id for p in pages)
            # Pages nothing needs to zero are pooled at once; zeroing runs in
            # tasks of their own: a cancelled Free (its client died) still
            # returns the pages.
            zeroing = []
            for u, g in by_pool.items():
                t = eager.start(self.pools[u].give_back(g), self._tasks)
                if t is not None:
                    zeroing.append(t)
            if zeroing:
                await asyncio.wait(zeroing)
            return len(pages), s

    def held_bytes(self, s: Session) -> int:
        return sum(n * self.pools[u].page_size for u, n in s.held_by_device.items())

    # ---- admin ----------------------------------------------------------
    def target_session(self, sid: int) -> Session:
        s = self.sessions.get(sid)
        if s is None:
            reason = self.tombstones.get(sid)
            if reason is not None:
                raise errors.FailedPrecondition(f"session {sid} is closed ({reason})")
            raise errors.NotFound(f"no session {sid}")
        return s

    def set_limits(self, sid: int, fields: dict) -> Session:
        allowed = {"guaranteed_bytes", "max_bytes", "priority"}
        unknown = set(fields) - allowed
        if unknown:
            raise errors.InvalidArgument(f"set_fields may name {sorted(allowed)}, not {sorted(unknown)}")
        if not fields:
            raise errors.InvalidArgument("set_fields is empty: name the limits to change")
        s = self.target_session(sid)
        g = fields.get("guaranteed_bytes", s.guaranteed_bytes)
        m = fields.get("max_bytes", s.max_bytes)
        admit(self._budgets(), session=f"{s.id} '{s.name}'", guaranteed_bytes=g, max_bytes=m,
              others_guaranteed=self._others_guaranteed(s))
        s.guaranteed_bytes, s.max_bytes = g, m
        s.priority = fields.get("priority", s.priority)
        self._journal({"op": "limits", "sid": s.id, "g": s.guaranteed_bytes, "m": s.max_bytes, "p": s.priority})
        for pool in self.pools.values():
            s.post(Event("BUDGET_CHANGED", time.time(), {
                "device": pool.uuid, "budget_bytes": pool.budget.bytes,
                "guaranteed_bytes": s.guaranteed_bytes, "max_bytes": s.max_bytes, "priority": s.priority}))
        log.info("session %d '%s' limits: guaranteed %d, max %d, priority %d", s.id, s.name, g, m, s.priority)
        return s

    def request_shrink(self, sid: int, target_bytes: int, timeout_ms: int, reason: str) -> list[Reclaim]:
        """Ask a session (through Watch) to hold at most target_bytes per
        device, never below its guarantee. Returns the RECLAIM events sent
        (one per device it holds more on; each settles when the session
        answers, meets it, ends, or the deadline passes)."""
        s = self.target_session(sid)
        timeout = (timeout_ms or self.settings.reclaim_timeout_ms) / 1000
        sent = []
        for pool in self.pools.values():
            keep = max(target_bytes, s.guaranteed_bytes) // pool.page_size
            extra = s.held_pages(pool.uuid) - keep - pending_pages(s, pool, time.time())
            if extra > 0:
                sent.append(self.reclaimer.ask(s, pool, extra, time.time() + timeout, reason))
        return sent

    def answer_reclaim(self, s: Session, reclaim_id: int, bytes_given: int, bytes_kept: int, why: str) -> int:
        """A session's answer to one of its RECLAIM events (an ANSWER record
        on its own fd channel). Returns the bytes the daemon's books show it
        holding on that device."""
        ev = self.reclaimer.answer(self.resolve(s, "AnswerReclaim"), reclaim_id, bytes_given, bytes_kept, why)
        return s.held_pages(ev.device) * ev.page_size

    # ---- watch ----------------------------------------------------------
    def watch(self, s: Session) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        q.put_nowait(Event("READY", time.time(), {}))
        s.watchers.append(q)
        return q

    def unwatch(self, s: Session, q: asyncio.Queue) -> None:
        if q in s.watchers:
            s.watchers.remove(q)

    # ---- life cycle -----------------------------------------------------
    def _check_serving(self) -> None:
        if self.shutting_down:
            raise errors.Unavailable("the daemon is shutting down")

    async def begin_shutdown(self, reason: str) -> None:
        """Tell every session, wait out the grace period (or until every
        session has gone). The adapters stop taking new work first."""
        self.shutting_down = True
        for pool in self.pools.values():
            pool.stop_refilling()
        loop = asyncio.get_running_loop()
        grace = self.settings.shutdown_grace
        ev = Event("SHUTDOWN", time.time(), {"reason": reason, "grace_seconds": grace})
        for s in list(self.sessions.values()):
            s.post(ev)
        deadline = loop.time() + grace
        while self.sessions and loop.time() < deadline:
            await asyncio.sleep(0.05)

    async def finish_shutdown(self) -> None:
        """End every session and release everything. Each step runs even if
        an earlier one failed; failures are logged and raised together at
        the end (ShutdownIncomplete), so a driver error cannot leave the
        other devices, the backend or the socket files behind."""
        self.shutting_down = True
        gone = errors.Unavailable("the daemon is shutting down")
        for s in list(self.sessions.values()):
            self.end_session(s, "daemon shutdown", farewell=gone)
        if self.ports is not None:
            self.ports.shutdown(gone)
        # Let the give_back tasks settle, then release everything.
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
        failures: list[str] = []

        def step(what: str, fn, final: bool) -> None:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - keep releasing the rest
                msg = exc.message if isinstance(exc, errors.KVCachedError) else f"{type(exc).__name__}: {exc}"
                if final:
                    log.error("shutdown: %s failed: %s", what, msg)
                    failures.append(f"{what}: {msg}")
                else:  # backend.close() retries whatever is left
                    log.warning("shutdown: %s failed (%s); retrying when the backend closes", what, msg)

        for pool in self.pools.values():
            step(f"releasing the pages of {pool.uuid}", pool.release_everything_sync, False)
        for worker in self.workers:
            step("stopping a device worker", worker.stop, False)
        self.workers.clear()
        step("closing the backend", self.backend.close, True)
        if self.journal is not None:  # every session ended: nothing left to resume
            self.journal.close(remove=True)
        if self.store is not None:  # nor to keep: the keeper exits once alone with an empty store
            self.store.clear()
            self.store.close()
            for fd in self.stored.values():
                os.close(fd)
            self.stored.clear()
        if failures:
            raise ShutdownIncomplete("; ".join(failures))


class _Observation:
    """The one place a core operation's outcome and latency are observed:
    `with _Observation(daemon, "Allocate"): ...` reports (operation, code,
    seconds, waited) to every Daemon.observers entry."""

    __slots__ = ("d", "op", "waited", "t0")

    def __init__(self, d: Daemon, op: str, waited: bool = False):
        self.d, self.op, self.waited = d, op, waited

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, kind, exc, tb) -> None:
        if exc is None:
            code = Code.OK
        elif isinstance(exc, asyncio.CancelledError):
            code = Code.CANCELLED
        else:
            code = errors.status_of(exc)[0]
        observers = self.d.observers
        if observers:
            seconds = time.perf_counter() - self.t0
            for fn in observers:
                fn(self.op, code, seconds, self.waited)


class ShutdownIncomplete(Exception):
    """Shutdown finished but could not release everything (the message says what)."""


# SessionPort is re-exported for the adapters' type hints.
__all__ = ["API_VERSION", "Allocated", "Bearer", "CORE_OPS", "Daemon", "Event", "SessionPort", "ShutdownIncomplete", "Who"]
