"""The daemon's core: pools, sessions, their limits, the life cycle.

No transport here. Two adapters sit beside it and translate:
- service.py, gRPC: protobuf in, Daemon calls, protobuf out;
- channel.py, the fd channel: records in, Daemon calls, records out. It
  also gives every session its SessionPort (deliver pages, hang up) and
  finds unbound channels for OpenSession/ResumeSession (PortDirectory).

Beside the core, each in its own module:
- identity.py (`self.identity`): who asks is a `Who`, a Session the fd
  channel vouches for (the kernel named the sender) or a `Bearer` (id,
  token, uid) from gRPC; it checks tokens, uids and admin rights, and
  refuses a Bearer's mutating requests unless --grpc-page-ops;
- ledger.py: the books a restart carries (`self.ledger`: sessions, pools,
  ids, tombstones, counters), and `self.recovery`, what the core asks of
  recovery/ (the journal, the sessions of a previous daemon and
  ResumeSession, the page store): a `RecoveryPort`, `NoRecovery` until
  ops/main.py attaches recovery/resume.py's Recovery (with --state-dir);
- pool/ (device.py): a loan (`DevicePool.lend`) admits (the budget is the pool's:
  `admit`), acquires and exports pages as one step with one rollback; the
  core decides what a shortage does (`_Patience`: wait, ask other sessions
  for pages), books the loan (the session, then, with --state-dir, the
  journal and page store: `Daemon.lend`) and hands it to the adapter that
  answers, which delivers it (the fd channel: PAGES records; gRPC: through
  the session's port, `Daemon.allocate`) or gives it back (`undelivered`).

The core operations both adapters call (Allocate, Free, CloseSession) are
observed once, here, at their boundary (`_Observation`): `observers` get
(operation, code, seconds, waited) for each; the metrics subscribe.

Everything runs on one event loop (the gRPC aio server's; uvloop by
default). fd channel requests run at once in the adapter's read callback
and become Tasks only when they must wait (channel.eager_start).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Callable, Iterable, NamedTuple

from ... import errors, fdchannel
from ...backends.base import Backend
from ...config import Settings, format_size
from ...errors import Code
from .elastic import Reclaim, Reclaimer, pending_pages
from .identity import Bearer, Identity, Who
from .ledger import Ledger, NoRecovery, RecoveryPort
from .pool import DevicePool, Page, PageIds, Shortage, admit
from .sessions import DeliveryFailed, PortDirectory, Session, SessionPort, Tombstones, check_labels, check_name
from .worker import DeviceWorker

log = logging.getLogger("kvcached.daemon")

API_VERSION = 1
SECRET_SIZE = 32  # the fd channel's HELLO secret, the session token, the resume token
# Operations observed by the core itself (both adapters reach them); the
# gRPC interceptor observes every other rpc.
CORE_OPS = frozenset({"Allocate", "Free", "CloseSession"})


@dataclass
class Event:
    """A Watch event before it becomes a protobuf (service.py converts)."""

    kind: str  # READY | RECLAIM | BUDGET_CHANGED | MEMORY_AVAILABLE | SHUTDOWN
    time_unix: float
    data: dict


class Allocated(NamedTuple):
    """A loan booked to its session, and the answer to its Allocate before
    an adapter encodes it (a NamedTuple: made on every Allocate, and a
    frozen dataclass costs more to build). `pages`, `fds`, `owned`: what
    delivering it takes (pool.Loan: whoever delivers closes the `owned`
    descriptors, those made for this delivery, once it is over)."""

    allocation_id: int
    device: str
    page_size: int
    page_ids: list[int]
    held_bytes: int
    pages: list[Page]
    fds: list[int]
    owned: tuple[int, ...]

    def close(self) -> None:
        """The delivery is over (sent or not): close what was made for it."""
        if self.owned:
            fdchannel.close_fds(list(self.owned))


def _by_device(pages: Iterable[Page]) -> dict[str, list[Page]]:
    """Pages grouped by their device (pool uuid), in order."""
    out: dict[str, list[Page]] = {}
    for page in pages:
        out.setdefault(page.device, []).append(page)
    return out


class Daemon:
    def __init__(self, settings: Settings, backend: Backend):
        self.settings = settings
        self.backend = backend
        # the books a restart carries (ledger.py); the names below are the same objects
        self.ledger = Ledger(counters={"sessions_opened": 0, "sessions_closed": 0, "sessions_crashed": 0, "fd_channel_errors": 0})
        self.pools: dict[str, DevicePool] = self.ledger.pools
        self.workers: list[DeviceWorker] = []
        self.sessions: dict[int, Session] = self.ledger.sessions
        self.ports: PortDirectory | None = None  # the fd channel adapter, once attached
        self.tombstones: Tombstones = self.ledger.tombstones
        self.page_ids: PageIds = self.ledger.page_ids
        self._alloc_ids = itertools.count(1)
        self.started_monotonic = time.monotonic()
        self.shutting_down = False
        self._tasks: set[asyncio.Task] = set()
        # Observers (metrics, the elasticity manager) may hook these.
        self.on_session_end: list[Callable[[Session, str], None]] = []
        # (operation, Code, seconds, waited) once per core operation (CORE_OPS)
        self.observers: list[Callable[[str, Code, float, bool], None]] = []
        self.counters = self.ledger.counters
        self.reclaimer = Reclaimer(lambda: list(self.sessions.values()), self._post, settings.reclaim_timeout_ms / 1000)
        # (session, pool uuid, pages): tell the session when that many pages could be had
        self._notify: list[tuple[Session, str, int]] = []
        self._supply_read = 0.0  # when the devices' free memory was last read (monotonic)
        self.identity = Identity(self.sessions, self.tombstones, settings)  # who is asking (identity.py)
        self.recovery: RecoveryPort = NoRecovery()  # ops/main.py attaches recovery/'s with --state-dir

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
            # zeroing runs on a thread of its own: never queued ahead of an Allocate's driver work
            zero_worker = DeviceWorker(self.backend, spec.ordinal, f"{spec.uuid[:7]}-zero")
            zero_worker.start()
            self.workers.append(zero_worker)
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
                tasks=self._tasks,
                zero_worker=zero_worker,
            )
            pool.on_pages_returned = self._pages_returned
            pool.keepers.ask = self._ask_drop
            pool.keepers.silent = self._keeper_silent
            pool.keepers.timeout = self.settings.fd_send_timeout
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
        self.ports = self.identity.ports = ports

    def attach_recovery(self, recovery: RecoveryPort) -> None:
        """recovery/'s Recovery (ops/main.py, with --state-dir), before the
        daemon serves: the core journals its changes through it from now on."""
        self.recovery = recovery

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
            self.recovery.rewrite_stale_journal(now)
            await self.recovery.restore_store(now)
            poll = self.settings.memory_poll_seconds
            if poll > 0 and now - self._supply_read >= poll:
                await self.refresh_supply()
            self.reclaimer.idle_scan(list(self.pools.values()), self.settings.idle_shrink_seconds)
            self.recovery.expire(now)

    def count(self, counter: str) -> None:
        """An event an adapter reports (e.g. fd_channel_errors)."""
        self.ledger.count(counter)

    def observe(self, op: str, code: Code, seconds: float, waited: bool = False) -> None:
        """Report one core operation to the observers. An adapter calls it
        itself only for a request of a core operation it had to refuse
        before reaching the core (a body it could not decode)."""
        for fn in self.observers:
            fn(op, code, seconds, waited)

    # ---- sessions -------------------------------------------------------
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
        port = self.identity.port(caller_uid, secret, "OpenSession")
        if len(self.sessions) >= self.settings.max_sessions:
            raise errors.ResourceExhausted(f"{len(self.sessions)} sessions open (max_sessions)")
        admit(self._budgets(), session=f"'{name}'", guaranteed_bytes=guaranteed_bytes, max_bytes=max_bytes,
              others_guaranteed=self._others_guaranteed(None))
        resume_token = secrets.token_bytes(SECRET_SIZE) if self.recovery.journaling else b""
        s = self.bind(port, id=self.ledger.next_session_id, name=name, labels=labels, guaranteed_bytes=guaranteed_bytes,
                      max_bytes=max_bytes, priority=priority,
                      resume_hash=hashlib.sha256(resume_token).hexdigest() if resume_token else "")
        self.ledger.next_session_id += 1
        s.resume_token = resume_token  # handed to the client once, never stored
        self.counters["sessions_opened"] += 1
        self.recovery.record({"op": "open", "sid": s.id, "uid": s.uid, "name": name, "rh": s.resume_hash,
                              "g": guaranteed_bytes, "m": max_bytes, "p": priority, "labels": labels}
                             | ({"pid": s.pid, "ps": s.pstart} if s.pstart else {}))
        log.info("session %d '%s' opened by pid %d uid %d%s", s.id, name, s.pid, s.uid, " (admin)" if s.admin else "")
        return s

    def bind(self, port: SessionPort, **fields) -> Session:
        """A live session on `port` (OpenSession, or ResumeSession through
        recovery/resume.py): a new token, admin by the port's uid."""
        s = Session(token=secrets.token_bytes(SECRET_SIZE), port=port, admin=self.settings.is_admin(port.uid), **fields)
        self.identity.directory().bind(port, s)
        self.sessions[s.id] = s
        return s

    def may_adopt(self, session_id: int, uid: int, page_id: int) -> bool:
        """Whether an ADOPT record's page is worth keeping until ResumeSession
        (the fd channel asks; recovery knows the orphans)."""
        return self.recovery.may_adopt(session_id, uid, page_id)

    async def resume_session(self, caller_uid: int | None, secret: bytes, sid: int, token: bytes,
                             page_ids: list[int]) -> tuple[Session, int, int]:
        """ResumeSession: recovery/resume.py's Recovery.resume checks the claim against
        the journal and adopts the pages. Returns (session, adopted, forgotten)."""
        self._check_serving()
        return await self.recovery.resume(caller_uid, secret, sid, token, page_ids)

    async def close_session(self, who: Who) -> int:
        """CloseSession: the session ends; returns the pages it gave back."""
        with _Observation(self, "CloseSession"):
            s = self.identity.resolve(who, "CloseSession")
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
        self._detach(s)
        self.tombstones.add(s.id, reason)
        self.counters["sessions_crashed" if crashed else "sessions_closed"] += 1
        if not self.shutting_down or self.sessions_outlive_a_stop():  # else the whole journal goes at the stop
            self.recovery.ended(s)
        by_pool = _by_device(s.pages.values())
        n = len(s.pages)
        for uuid, pages in by_pool.items():
            pool = self.pools[uuid]
            s.remove_pages(pages)
            # stopping: released, never lent again, so not zeroed under a client that still maps them
            pool.give_back_now(pages, lend_again=not self.shutting_down)
        self.reclaimer.session_ended(s)
        s.port.hang_up(farewell, pages_returned=n)
        for hook in self.on_session_end:
            hook(s, reason)
        log.info("session %d '%s' ended (%s): %d pages returned", s.id, s.name, reason, n)
        return n

    def _detach(self, s: Session) -> None:
        """What ending and leaving a session share: it is closed and gone
        from the live sessions, its client's kept handles are let go, its
        Watch streams end."""
        s.closed = True
        self.sessions.pop(s.id, None)
        for pool in self.pools.values():
            pool.keepers.forget(s)  # its client lets its kept handles go with the session
        for q in s.watchers:
            q.put_nowait(None)

    # ---- pages ----------------------------------------------------------
    def pool(self, device: str) -> DevicePool:
        if not device:
            return next(iter(self.pools.values()))
        pool = self.pools.get(device)
        if pool is None:
            raise errors.NotFound(f"no device {device!r}; this daemon serves {', '.join(self.pools)}")
        return pool

    async def lend(self, s: Session, device: str, count: int, wait: bool, wait_ms: int, notify: bool,
                   alloc_id: int) -> Allocated:
        """An ALLOCATE on the session's own fd channel: `s` is the session
        bound to that channel (the kernel named the peer), so no identity is
        resolved; it must still be open. Returns the loan, booked: the
        adapter delivers it, then answers, or calls `undelivered`."""
        with _Observation(self, "Allocate", wait):
            if s.closed:
                raise errors.FailedPrecondition(f"session {s.id} is closed")
            a = await self._lend(s, device, count, wait, wait_ms, notify, alloc_id)
            s.allocations_total += 1
            return a

    async def allocate(self, who: Who, device: str, count: int, wait: bool, wait_ms: int, notify: bool = False) -> Allocated:
        """Allocate over gRPC (--grpc-page-ops): the caller checked, the
        loan, delivered through the session's port, then the answer."""
        with _Observation(self, "Allocate", wait):
            s = self.identity.resolve(who, "Allocate")
            a = await self._lend(s, device, count, wait, wait_ms, notify, next(self._alloc_ids))
            try:
                await s.port.deliver(a.allocation_id, a.page_ids, a.fds)
            except BaseException as exc:
                self.undelivered(s, a, exc)
                raise
            finally:
                a.close()  # sent (the client has its own now) or not: exports made for it go
            s.allocations_total += 1
            s.touch()
            return a._replace(held_bytes=s.held_pages(a.device) * a.page_size, fds=[])

    async def _lend(self, s: Session, device: str, count: int, wait: bool, wait_ms: int, notify: bool,
                    alloc_id: int) -> Allocated:
        """A loan of `count` pages to `s`: the pool admits, acquires and
        exports them (what a shortage does: `_Patience`); then they are
        booked to the session and, with --state-dir, to the journal and the
        page store, before any client can hold them."""
        self._check_serving()
        limit = self.settings.max_pages_per_request
        if count <= 0 or count > limit:
            raise errors.InvalidArgument(f"num_pages must be 1..{limit}, got {count}")
        pool = self.pool(device)
        loan = await pool.lend(s, count, _Patience(self, s, pool, wait, wait_ms, notify, count))
        pages = loan.pages
        held = s.book_loan(pages)  # the session's, and active now
        a = Allocated(alloc_id, pool.uuid, pool.page_size, [p.id for p in pages], held * pool.page_size,
                      pages, loan.fds, loan.owned)
        if self.recovery.journaling:  # an attribute, not a call: nothing to book without --state-dir
            try:
                self.recovery.lent(s, pool, pages, loan.fds)
            except BaseException as exc:
                loan.close()
                self.undelivered(s, a, exc)
                raise
        return a

    def undelivered(self, s: Session, a: Allocated, exc: BaseException) -> None:
        """A loan that did not reach its client (`exc`: the port failed, or
        the caller gave up before the answer and never learns these page
        ids): the session must not keep its pages (a session that ended
        meanwhile gave them back itself). A failed delivery
        (DeliveryFailed) also ends the session: raises Unavailable."""
        if not s.closed and all(p.id in s.pages for p in a.pages):
            s.remove_pages(a.pages)
            self.recovery.returned(s, a.pages)
            self.pools[a.device].give_back_now(a.pages)
        if isinstance(exc, DeliveryFailed):
            self.count("fd_channel_errors")
            err = errors.Unavailable(f"could not deliver pages on session {s.id}'s fd channel: {exc}")
            self.end_session(s, str(exc), farewell=err)
            raise err from None

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

    async def free(self, who: Who, page_ids: list[int], keep: bool = False) -> tuple[int, Session]:
        """Free: all or nothing. Returns (pages freed, the session). `keep`:
        the client keeps the pages' imported handles (a FREE record with the
        keep flag): the session becomes their keeper (pool/keepers.py)."""
        with _Observation(self, "Free"):
            s = self.identity.resolve(who, "Free")
            pages = self._held(s, page_ids)
            by_pool = _by_device(pages)
            for uuid, group in by_pool.items():
                s.remove_pages(group)
                if s.asks:
                    self.reclaimer.settle(s, uuid, len(group))
            s.frees_total += 1
            s.touch()
            self.recovery.returned(s, pages)
            # Answered once the books say so: pages nothing needs to zero are
            # pooled at once, the others are zeroed in the background (the
            # pool's zeroer) and lent only once that is done.
            for u, g in by_pool.items():
                self.pools[u].give_back_now(g, keeper=s if keep else None)
            return len(pages), s

    def standby(self, s: Session, page_ids: list[int]) -> int:
        """A FREE with the standby flag: the pages stay the session's, kept
        mapped by its client as standby (docs/protocol.md, "Standby pages");
        all or nothing, checked as a Free. Returns pages named."""
        with _Observation(self, "Free"):
            pages = self._held(s, page_ids)
            for uuid, group in _by_device(pages).items():
                self.pools[uuid].set_standby(group, True)
            s.frees_total += 1
            s.touch()
            return len(pages)

    def use(self, s: Session, page_ids: list[int]) -> int:
        """USE: standby pages of the session in use again. Pages it does not
        hold, or holds in use, are no error. Returns pages changed."""
        if not page_ids:
            raise errors.InvalidArgument("page_ids is empty: name the pages to use")
        standby = (p for p in map(s.pages.get, page_ids) if p is not None and p.standby)
        s.touch()
        return sum(self.pools[u].set_standby(g, False) for u, g in _by_device(standby).items())

    def _held(self, s: Session, page_ids: list[int]) -> list[Page]:
        """The pages a Free names, checked (all or nothing)."""
        if not page_ids:
            raise errors.InvalidArgument("page_ids is empty: name the pages to free")
        seen: set[int] = set()
        busy = s.port.delivering  # pages whose PAGES still wait for room in the channel
        pages: list[Page] = []
        for pid in page_ids:
            if pid in seen:
                raise errors.InvalidArgument(f"page {pid} appears more than once; nothing was freed")
            seen.add(pid)
            page = s.pages.get(pid)
            if page is None:
                raise errors.NotFound(f"page {pid} is not held by session {s.id}; nothing was freed")
            if busy and pid in busy:
                raise errors.FailedPrecondition(f"page {pid} is still being delivered; nothing was freed")
            pages.append(page)
        return pages

    def dropped(self, s: Session, page_ids: list[int]) -> int:
        """DROPPED on the session's fd channel: its client keeps no handle of
        these pages any more. Returns how many of them it was keeping."""
        if not page_ids:
            raise errors.InvalidArgument("page_ids is empty: name the pages dropped")
        return sum(pool.keepers.dropped(s, page_ids) for pool in self.pools.values())

    def _ask_drop(self, s: Session, page_ids: list[int]) -> None:
        """A pool is about to release pages `s` keeps handles of: ask its client."""
        if not s.closed:
            s.port.ask_drop(page_ids)

    def _keeper_silent(self, s: Session, pages: int) -> None:
        """A keeper did not answer DROP in time: its session ends."""
        why = f"did not answer DROP of {pages} pages within {self.settings.fd_send_timeout:g} s"
        self.count("fd_channel_errors")
        self.end_session(s, why, farewell=errors.Unavailable(f"session ended: {why}"))

    def held_bytes(self, s: Session) -> int:
        return sum(n * self.pools[u].page_size for u, n in s.held_by_device.items())

    # ---- admin ----------------------------------------------------------
    def set_limits(self, sid: int, fields: dict) -> Session:
        allowed = {"guaranteed_bytes", "max_bytes", "priority"}
        unknown = set(fields) - allowed
        if unknown:
            raise errors.InvalidArgument(f"set_fields may name {sorted(allowed)}, not {sorted(unknown)}")
        if not fields:
            raise errors.InvalidArgument("set_fields is empty: name the limits to change")
        s = self.identity.target(sid)
        g = fields.get("guaranteed_bytes", s.guaranteed_bytes)
        m = fields.get("max_bytes", s.max_bytes)
        admit(self._budgets(), session=f"{s.id} '{s.name}'", guaranteed_bytes=g, max_bytes=m,
              others_guaranteed=self._others_guaranteed(s))
        s.guaranteed_bytes, s.max_bytes = g, m
        s.priority = fields.get("priority", s.priority)
        self.recovery.record({"op": "limits", "sid": s.id, "g": s.guaranteed_bytes, "m": s.max_bytes, "p": s.priority})
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
        s = self.identity.target(sid)
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
        ev = self.reclaimer.answer(self.identity.resolve(s, "AnswerReclaim"), reclaim_id, bytes_given, bytes_kept, why)
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

    def sessions_outlive_a_stop(self) -> bool:
        """Whether a clean stop keeps the sessions for the next start: with a
        journal that is up to date (--state-dir), a stop (SIGTERM,
        `systemctl restart`) leaves them as a crash would, in the journal
        and the page store, and their clients resume them; without one it
        ends them."""
        return self.recovery.journaling and self.recovery.journal_stale is None

    async def begin_shutdown(self, reason: str) -> None:
        """Unless the sessions outlive the stop: tell every session
        (SHUTDOWN), wait out the grace period (or until every session has
        gone). The adapters stop taking new work first."""
        self.shutting_down = True
        for pool in self.pools.values():
            pool.stop_refilling()
        loop = asyncio.get_running_loop()
        if self.sessions_outlive_a_stop():
            # no SHUTDOWN: a client takes that for its session's end (the C
            # client marks it ended); its session outlives this stop instead.
            # No request is read or refused from here on (an Allocate refused
            # "shutting down" failed a runner's request in the chaos run).
            if self.ports is not None:
                self.ports.pause()
            return
        grace = self.settings.shutdown_grace
        ev = Event("SHUTDOWN", time.time(), {"reason": reason, "grace_seconds": grace})
        for s in list(self.sessions.values()):
            s.post(ev)
        deadline = loop.time() + grace
        while self.sessions and loop.time() < deadline:
            await asyncio.sleep(0.05)

    def leave_session(self, s: Session) -> None:
        """A stop the session outlives: it stays in the journal (its pages in
        the page store) and its channel closes without a word, so its client
        keeps every page and resumes it at the next start. The daemon's own
        references go with the pool (release_everything_sync): nothing is
        zeroed, nothing lent again."""
        self._detach(s)
        s.port.leave()
        log.info("session %d '%s' left for the next start: %d pages stay with its client", s.id, s.name, len(s.pages))

    async def finish_shutdown(self) -> None:
        """End every session (or leave them for the next start:
        `sessions_outlive_a_stop`) and release everything. Each step runs
        even if an earlier one failed; failures are logged and raised
        together at the end (ShutdownIncomplete), so a driver error cannot
        leave the other devices, the backend or the socket files behind."""
        self.shutting_down = True
        keep = self.sessions_outlive_a_stop()
        left = len(self.sessions)
        gone = errors.Unavailable("the daemon is shutting down")
        for s in list(self.sessions.values()):
            if keep:
                self.leave_session(s)
            else:
                self.end_session(s, "daemon shutdown", farewell=gone)
        if self.ports is not None:
            self.ports.shutdown(None if keep else gone)
        # Let the zeroing tasks settle, then release everything.
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
        self.recovery.close(keep=keep and left > 0)  # with no session left the journal goes (orphans aside)
        if failures:
            raise ShutdownIncomplete("; ".join(failures))


class _Patience:
    """What an Allocate does when its pool is short (DevicePool.lend calls
    it with the Shortage; returning means try again, raising gives up):
    read the device's free memory when the budget is capped by it; refuse
    unless the caller may wait (then optionally note that it wants to know
    when pages come back: MEMORY_AVAILABLE); otherwise ask other sessions
    for pages (elastic.Reclaimer) and wait for pages to come back, until
    the deadline (wait_ms, else default_wait_ms, from the first shortage)."""

    __slots__ = ("d", "s", "pool", "wait", "wait_ms", "notify", "count", "deadline", "asked")

    def __init__(self, d: "Daemon", s: Session, pool: DevicePool, wait: bool, wait_ms: int, notify: bool, count: int):
        self.d, self.s, self.pool, self.wait, self.wait_ms, self.notify, self.count = d, s, pool, wait, wait_ms, notify, count
        self.deadline: float | None = None
        self.asked: dict[int, tuple[Session, int, int]] = {}  # id -> (session, pages asked, held when first asked)

    async def __call__(self, short: Shortage) -> None:
        d, s, pool = self.d, self.s, self.pool
        loop = asyncio.get_running_loop()
        wait_s = (self.wait_ms or d.settings.default_wait_ms) / 1000
        if self.deadline is None:
            self.deadline = loop.time() + wait_s
        if pool.budget_pages < pool.limit_pages and time.monotonic() - d._supply_read > 0.1:
            # capped by what the device had: it may have more now (a client of a
            # previous daemon exited); read it before refusing or reclaiming
            before = pool.budget_pages
            await d.refresh_supply([pool])
            if pool.budget_pages > before:
                return
        now = loop.time()
        if not self.wait or now >= self.deadline:
            pool.note_failure()
            if self.notify:
                d._notify.append((s, pool.uuid, self.count))
            if not self.wait:
                raise short
            raise errors.ResourceExhausted(self._waited_message(short, wait_s)) from None
        for victim, n in d.reclaimer.request(pool, s, short.missing, time.time() + (self.deadline - now)):
            _, prev, held0 = self.asked.get(victim.id, (victim, 0, victim.held_pages(pool.uuid) + n))
            self.asked[victim.id] = (victim, prev + n, held0 - n if prev == 0 else held0)
        await pool.wait_changed(min(self.deadline - now, 0.25))
        if s.closed:
            raise errors.FailedPrecondition(f"session {s.id} closed while waiting for pages")

    def _waited_message(self, short: Shortage, waited: float) -> str:
        msg = f"after waiting {waited:g} s, still {short.missing} pages short: {short.message}"
        if not self.asked:
            return msg + "; no session had pages above its guarantee to ask for"
        parts = []
        for v, n, held0 in self.asked.values():
            given = max(0, held0 - v.held_pages(self.pool.uuid))
            state = "session ended" if v.closed else f"gave back {min(given, n)}"
            parts.append(f"session {v.id} '{v.name}' {n} pages ({state}{'; ignored requests before' if v.reclaim_ignored else ''})")
        return msg + "; asked to give back: " + ", ".join(parts)


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
