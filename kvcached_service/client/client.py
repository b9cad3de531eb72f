"""Python client of kvcached-serve.

    from kvcached_service.client import Client

    with Client.connect("/tmp/kvcached.sock") as client:       # or Client.from_env()
        with client.open_session("llama3:8b") as session:
            pages = session.allocate(4)                        # mapped into this process
            pages[0].write(0, b"hello")
            session.free(pages)
            region = session.region(1 << 30)                   # reserve 1 GiB of address space
            region.map(0, 64 << 20)                            # back the first 64 MiB
            region.unmap(32 << 20, 32 << 20)                   # give half back

Every failed call raises a subclass of kvcached_service.errors.KVCachedError
(gRPC errors are mapped in one place, `_call`).
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Sequence

import grpc

from .. import errors, fdchannel
from .._generated.kvcached.v1 import kvcached_pb2 as pb
from .._generated.kvcached.v1 import kvcached_pb2_grpc as pb_grpc
from .mapping import HostMapper, Mapper

if TYPE_CHECKING:
    from .region import Region

ENV_VARS = ("KVCACHED_SOCKET", "OLLAMA_KVCACHED_SOCKET")

log = logging.getLogger("kvcached.client")

# Reconnect quickly after a daemon restart (gRPC's default backoff grows to minutes).
_CHANNEL_OPTIONS = [
    ("grpc.enable_http_proxy", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 1000),  # also the connect timeout: not too short
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def _call(fn, request, timeout: float | None = None):
    """Run one unary rpc; map a gRPC failure to the error taxonomy."""
    try:
        return fn(request, timeout=timeout)
    except grpc.RpcError as exc:
        raise errors.from_rpc_error(exc) from None


# ---- domain types ----------------------------------------------------------
@dataclass(frozen=True)
class Device:
    uuid: str
    name: str
    kind: str
    page_size: int
    granularity: int
    total_bytes: int
    budget_bytes: int

    @classmethod
    def from_pb(cls, m: pb.DeviceInfo) -> "Device":
        return cls(m.uuid, m.name, m.kind, m.page_size, m.granularity, m.total_bytes, m.budget_bytes)


@dataclass(frozen=True)
class PoolStats:
    budget_bytes: int
    pooled_bytes: int
    in_use_bytes: int
    free_bytes: int
    page_size: int
    pages_pooled: int
    pages_in_use: int
    pages_created_total: int
    pages_released_total: int

    @classmethod
    def from_pb(cls, m: pb.PoolStats) -> "PoolStats":
        return cls(*(getattr(m, f) for f in cls.__dataclass_fields__))


@dataclass(frozen=True)
class SessionStats:
    id: int
    name: str
    pid: int
    uid: int
    held_bytes: int
    pages_held: int
    guaranteed_bytes: int
    max_bytes: int
    priority: int
    last_active_unix: float
    reclaim_ignored: int
    allocations_total: int
    frees_total: int
    labels: dict
    opened_unix: float
    held_bytes_by_device: dict
    reclaim_pending_pages: int
    reclaim_requests: int

    @classmethod
    def from_pb(cls, m: pb.SessionStats) -> "SessionStats":
        vals = {f: getattr(m, f) for f in cls.__dataclass_fields__}
        vals["labels"] = dict(m.labels)
        vals["held_bytes_by_device"] = dict(m.held_bytes_by_device)
        return cls(**vals)


@dataclass(frozen=True)
class Stats:
    total: PoolStats
    devices: dict[str, PoolStats]
    sessions: list[SessionStats]
    uptime_seconds: float
    sessions_open: int

    @classmethod
    def from_pb(cls, m: pb.GetStatsResponse) -> "Stats":
        return cls(
            PoolStats.from_pb(m.total),
            {d.device.uuid: PoolStats.from_pb(d.pool) for d in m.devices},
            [SessionStats.from_pb(s) for s in m.sessions],
            m.uptime_seconds,
            m.sessions_open,
        )


@dataclass(frozen=True)
class Event:
    """A Watch event. kind: READY, RECLAIM, BUDGET_CHANGED, MEMORY_AVAILABLE, SHUTDOWN."""

    kind: str
    time_unix: float
    device: str = ""
    pages: int = 0
    deadline_unix: float = 0.0
    reason: str = ""
    data: dict = field(default_factory=dict)

    @classmethod
    def from_pb(cls, m: pb.WatchEvent) -> "Event":
        kind = pb.WatchEvent.Kind.Name(m.kind)
        if kind == "RECLAIM":
            r = m.reclaim
            return cls(kind, m.time_unix, r.device, r.pages, r.deadline_unix, r.reason)
        if kind == "MEMORY_AVAILABLE":
            return cls(kind, m.time_unix, m.available.device, m.available.pages)
        if kind == "SHUTDOWN":
            return cls(kind, m.time_unix, reason=m.shutdown.reason, data={"grace_seconds": m.shutdown.grace_seconds})
        if kind == "BUDGET_CHANGED":
            b = m.budget
            return cls(kind, m.time_unix, b.device, data={
                "budget_bytes": b.budget_bytes, "guaranteed_bytes": b.guaranteed_bytes,
                "max_bytes": b.max_bytes, "priority": b.priority})
        return cls(kind, m.time_unix)


# ---- the fd channel, client side -------------------------------------------
class _Channel:
    """The client's end of the fd channel. A reader thread takes every
    record off the socket as it arrives (the daemon writes an allocation's
    fds before the rpc answers, and an allocation can be larger than a
    socket buffer), keeping PAGES by allocation id until `receive` claims
    them. Records nobody claims within STALE_AFTER seconds (the rpc that
    asked for them failed) are closed. The end of the stream (the daemon
    went away, or ended the session) calls `on_hangup` once."""

    STALE_AFTER = 120.0

    def __init__(self, path: str, timeout: float, on_hangup: Callable[["_Channel"], None] | None = None):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self.sock.settimeout(timeout)
        self.timeout = timeout
        try:
            self.sock.connect(path)
            rec = fdchannel.recv_record(self.sock)
        except OSError as exc:
            self.sock.close()
            raise errors.Unavailable(f"cannot connect the fd channel {path}: {exc}") from None
        if isinstance(rec, fdchannel.Error):
            self.sock.close()
            raise errors.from_code(rec.code, rec.message)
        if not isinstance(rec, fdchannel.Hello):
            self.sock.close()
            raise errors.Unavailable(f"fd channel {path}: expected HELLO, got {rec!r}")
        self.hello = rec
        self.sock.settimeout(None)
        self._cond = threading.Condition()
        # alloc -> (first arrival, {index: (page id, fd)})
        self._stash: dict[int, tuple[float, dict[int, tuple[int, int]]]] = {}
        self._ended: errors.KVCachedError | None = None
        self._closing = False
        self._replies: dict[int, fdchannel.Reply] = {}
        self._totals: dict[int, int] = {}  # allocation id -> pages it has in all
        self._req_ids = itertools.count(1)
        self.on_hangup = on_hangup
        self._reader = threading.Thread(target=self._read, name="kvcached-fdchannel", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        ended: errors.KVCachedError
        while True:
            try:
                rec = fdchannel.recv_record(self.sock)
            except fdchannel.ProtocolError:
                continue  # its descriptors are closed; the stream goes on
            except OSError as exc:
                ended = errors.Unavailable(f"fd channel failed: {exc}")
                break
            if isinstance(rec, fdchannel.Reply):
                with self._cond:
                    self._replies[rec.req_id] = rec
                    self._cond.notify_all()
                continue
            if isinstance(rec, fdchannel.Pages):
                with self._cond:
                    self._totals[rec.allocation_id] = rec.total
                    slot = self._stash.setdefault(rec.allocation_id, (time.monotonic(), {}))[1]
                    for i, (pid, fd) in enumerate(zip(rec.page_ids, rec.fds)):
                        slot[rec.first_index + i] = (pid, fd)
                    self._purge_stale()
                    self._cond.notify_all()
                continue
            if isinstance(rec, fdchannel.Error):
                ended = errors.from_code(rec.code, rec.message)
            elif rec is None or isinstance(rec, fdchannel.Goodbye):
                ended = errors.Unavailable("the daemon closed this session's fd channel")
            else:
                continue
            break
        with self._cond:
            self._ended = ended
            self._cond.notify_all()
            closing = self._closing
        if not closing and self.on_hangup is not None:
            self.on_hangup(self)

    def _purge_stale(self) -> None:
        now = time.monotonic()
        for alloc in [a for a, (t, _) in self._stash.items() if now - t > self.STALE_AFTER]:
            fdchannel.close_fds(fd for _, fd in self._stash.pop(alloc)[1].values())
            self._totals.pop(alloc, None)

    def request(self, record: bytes, req_id: int, timeout: float) -> fdchannel.Reply:
        """Send a request record and wait for its REPLY (raised as the
        error its code names)."""
        try:
            fdchannel.send_record(self.sock, record)
        except OSError as exc:
            raise errors.Unavailable(f"fd channel failed: {exc}") from None
        with self._cond:
            self._cond.wait_for(lambda: req_id in self._replies or self._ended is not None, timeout)
            rep = self._replies.pop(req_id, None)
            if rep is None:
                if self._ended is not None:
                    raise self._ended
                raise errors.DeadlineExceeded(f"no answer on the fd channel within {timeout:g} s")
        if rep.code:
            raise errors.from_code(rep.code, rep.message)
        return rep

    def next_request_id(self) -> int:
        return next(self._req_ids)

    def receive_all(self, alloc_id: int) -> tuple[list[int], list[int]]:
        """(page ids, fds) of an allocation asked for on the channel: its
        PAGES records came before the REPLY, so they are all here."""
        with self._cond:
            total = self._totals.pop(alloc_id, 0)
            got = self._stash.pop(alloc_id, (0, {}))[1]
        if len(got) != total or total == 0:
            fdchannel.close_fds(fd for _, fd in got.values())
            raise errors.Internal(f"allocation {alloc_id}: {len(got)} of {total} pages arrived before the answer")
        return [got[i][0] for i in range(total)], [got[i][1] for i in range(total)]

    def receive(self, alloc_id: int, page_ids: Sequence[int]) -> list[int]:
        """The fds of an allocation, in page order. They were written before
        the rpc answered, so this waits only for the reader thread."""
        total = len(page_ids)
        with self._cond:
            self._cond.wait_for(
                lambda: len(self._stash.get(alloc_id, (0, {}))[1]) >= total or self._ended is not None, self.timeout
            )
            if len(self._stash.get(alloc_id, (0, {}))[1]) < total:
                if self._ended is not None:
                    raise self._ended
                raise errors.Unavailable(f"fds of allocation {alloc_id} did not arrive within {self.timeout:g} s")
            got = self._stash.pop(alloc_id)[1]
            self._totals.pop(alloc_id, None)
        fds = [got[i][1] for i in range(total)]
        ids = [got[i][0] for i in range(total)]
        if ids != list(page_ids):
            fdchannel.close_fds(fds)
            raise errors.Internal(f"allocation {alloc_id}: fd channel page ids {ids[:4]}... differ from the rpc's")
        return fds

    def close(self) -> None:
        with self._cond:
            self._closing = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the reader
        except OSError:
            pass
        if self._reader is not threading.current_thread():
            self._reader.join(timeout=5)
        with self._cond:
            for _, slot in self._stash.values():
                fdchannel.close_fds(fd for _, fd in slot.values())
            self._stash.clear()
        self.sock.close()


# ---- pages -------------------------------------------------------------------
class _Reservation:
    """Address space reserved for one allocate() call; released when its
    last page is freed."""

    def __init__(self, mapper: Mapper, size: int):
        self.mapper = mapper
        self.size = size
        self.base = mapper.reserve(size)
        self.live = 0

    def drop(self) -> None:
        self.live -= 1
        if self.live == 0:
            self.mapper.release(self.base, self.size)


class Page:
    """One page mapped into this process at `addr`."""

    def __init__(self, page_id: int, device: str, size: int, addr: int, mapper: Mapper, token: object, res: _Reservation | None):
        self.id = page_id
        self.device = device
        self.size = size
        self.addr = addr
        self._mapper = mapper
        self._token = token
        self._res = res
        self.mapped = True

    def write(self, offset: int, data: bytes) -> None:
        self._check(offset, len(data))
        self._mapper.write(self.addr + offset, data)

    def read(self, offset: int = 0, size: int | None = None) -> bytes:
        size = self.size - offset if size is None else size
        self._check(offset, size)
        return self._mapper.read(self.addr + offset, size)

    def _check(self, offset: int, size: int) -> None:
        if not self.mapped:
            raise errors.FailedPrecondition(f"page {self.id} is not mapped any more")
        if offset < 0 or size < 0 or offset + size > self.size:
            raise errors.InvalidArgument(f"range [{offset}, {offset + size}) is outside page {self.id} of {self.size} bytes")

    def _unmap(self) -> None:
        if self.mapped:
            self._mapper.unmap(self.addr, self.size, self._token)
            self.mapped = False
            if self._res is not None:
                self._res.drop()

    def __repr__(self) -> str:
        return f"Page(id={self.id}, device={self.device!r}, addr=0x{self.addr:x}, size={self.size})"


# ---- sessions ----------------------------------------------------------------
class Session:
    """A session: pages lent to this process. Not shared across processes."""

    def __init__(self, client: "Client", name: str, guaranteed_bytes: int, max_bytes: int, priority: int, labels: dict[str, str] | None):
        self.client = client
        self.name = name
        self._channel = _Channel(client.info.fd_socket, client.timeout, self._hangup)
        try:
            resp = _call(
                client._stub.OpenSession,
                pb.OpenSessionRequest(
                    channel_secret=self._channel.hello.secret,
                    name=name,
                    guaranteed_bytes=guaranteed_bytes,
                    max_bytes=max_bytes,
                    priority=priority,
                    labels=labels or {},
                ),
                client.timeout,
            )
        except BaseException:
            self._channel.close()
            raise
        self.ref = resp.session
        self.id = resp.session.id
        self.pid, self.uid, self.gid, self.admin = resp.pid, resp.uid, resp.gid, resp.admin
        self._mappers: dict[str, Mapper] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._watch_threads: list[threading.Thread] = []
        self._calls: list[grpc.Future] = []
        # Resume after a daemon restart (the daemon keeps a journal): keep a
        # duplicate fd of every page held, to prove and re-send it.
        self.resume_token = resp.resume_token
        self.resumable = bool(resp.resume_token)
        # page id -> (sequence, dup fd). The daemon lends a freed page again
        # under the same id, possibly to another thread of this session
        # before the first thread's Free has returned: the sequence lets a
        # Free drop only the entry it saw.
        self._keep: dict[int, tuple[int, int]] = {}
        self._keep_seq = 0
        self._deferred_free: dict[int, int] = {}  # page id -> sequence of the kept fd
        self._state = "ok"  # ok | resuming | dead
        self._dead: errors.KVCachedError | None = None
        self._resumed = threading.Event()
        self._resumed.set()
        self.resumes = 0

    # -- plumbing
    def _check_state(self) -> None:
        if self._state == "resuming":
            raise errors.Unavailable(f"the daemon went away; session {self.id} is being resumed: the pages you hold stay usable, try again shortly")
        if self._state == "dead":
            raise self._dead

    def _rpc(self, method: str, request, timeout: float | None = None):
        self._check_state()
        try:
            return _call(getattr(self.client._stub, method), request, timeout or self.client.timeout)
        except errors.Unavailable as exc:
            if not self.resumable or self._closed:
                raise
            raise errors.Unavailable(
                f"the daemon is unreachable; session {self.id} resumes when it is back and the pages you hold stay usable ({exc.message})"
            ) from None

    # -- resume after a daemon restart
    def _hangup(self, ch: "_Channel") -> None:
        """The fd channel ended (reader thread). A resumable session resumes
        on a thread of its own; any other session is over."""
        if self._closed or ch is not self._channel:
            return
        if self.resumable:
            threading.Thread(target=self._resume, name=f"kvcached-resume-{self.id}", daemon=True).start()

    def _resume(self, timeout: float = 120.0) -> None:
        self._state = "resuming"
        self._resumed.clear()
        log.warning("session %d: the daemon went away; resuming (holding %d pages)", self.id, len(self._keep))
        delay, deadline = 0.05, time.monotonic() + timeout
        while not self._closed and time.monotonic() < deadline:
            try:
                ch = _Channel(self.client.info.fd_socket, self.client.timeout, self._hangup)
            except errors.KVCachedError:
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            try:
                with self._lock:
                    # Pages whose Free failed while the daemon was away are
                    # not claimed (the old daemon may or may not have freed
                    # them): the new one forgets them, which frees them.
                    for i, seq in self._deferred_free.items():
                        kept = self._keep.get(i)
                        if kept is not None and kept[0] == seq:
                            fdchannel.close_fds([self._keep.pop(i)[1]])
                    self._deferred_free.clear()
                    ids = list(self._keep)
                    for i in range(0, len(ids), fdchannel.MAX_FDS):
                        chunk = ids[i : i + fdchannel.MAX_FDS]
                        fdchannel.send_record(ch.sock, fdchannel.encode_adopt(self.id, i, len(ids), chunk), [self._keep[x][1] for x in chunk])
                resp = _call(
                    self.client._stub.ResumeSession,
                    pb.ResumeSessionRequest(channel_secret=ch.hello.secret, session_id=self.id, resume_token=self.resume_token, page_ids=ids),
                    self.client.timeout,
                )
            except (errors.Unavailable, OSError):
                ch.close()
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            except errors.KVCachedError as exc:
                ch.close()
                self._dead = errors.FailedPrecondition(f"session {self.id} could not be resumed after the daemon restarted: {exc.message}")
                self._state = "dead"
                self._resumed.set()
                log.error("%s", self._dead.message)
                return
            old, self._channel = self._channel, ch
            old.on_hangup = None
            old.close()
            self.ref = resp.session
            self.resumes += 1
            self._state = "ok"
            self._resumed.set()
            log.warning("session %d resumed: %d pages adopted, %d forgotten", self.id, resp.pages_adopted, resp.pages_forgotten)
            if ch._ended is not None:  # the daemon went away again before the swap
                self._hangup(ch)
            return
        self._dead = errors.Unavailable(f"session {self.id}: the daemon did not come back within {timeout:g} s")
        self._state = "dead"
        self._resumed.set()

    def wait_resumed(self, timeout: float | None = None) -> bool:
        """Block until the session is usable again after a daemon restart."""
        return self._resumed.wait(timeout) and self._state == "ok"

    def mapper(self, device: str) -> Mapper:
        with self._lock:
            m = self._mappers.get(device)
            if m is None:
                kind = self.client.device(device).kind
                if kind == "host":
                    m = HostMapper()
                elif kind == "cuda":
                    from .cuda_mapper import CudaMapper

                    m = CudaMapper(device)
                else:
                    raise errors.FailedPrecondition(f"device {device} has kind {kind!r}, which this client cannot map")
                self._mappers[device] = m
            return m

    # -- raw pages (fds; the caller maps them)
    def allocate_fds(self, num_pages: int, device: str = "", wait: bool = False, wait_timeout_ms: int = 0, notify: bool = False) -> tuple[pb.AllocateResponse, list[int]]:
        """Allocate and return the rpc answer and one fd per page (caller
        closes). wait: let the daemon reclaim from other sessions for up to
        wait_timeout_ms (0 = its default). notify: if it fails for lack of
        memory, get a MEMORY_AVAILABLE event when enough pages are free."""
        wait_budget = (wait_timeout_ms or 60_000) / 1000 if wait else 0
        if self.client.channel_requests:
            return self._allocate_on_channel(num_pages, device, wait, wait_timeout_ms, notify, self.client.timeout + wait_budget)
        resp = self._rpc(
            "Allocate",
            pb.AllocateRequest(session=self.ref, device=device, num_pages=num_pages, wait=wait,
                               wait_timeout_ms=wait_timeout_ms, notify_when_available=notify),
            self.client.timeout + wait_budget,
        )
        fds = self._channel.receive(resp.allocation_id, resp.page_ids)
        self._keep_fds(resp.page_ids, fds)
        return resp, fds

    def _keep_fds(self, ids: Sequence[int], fds: Sequence[int]) -> None:
        """A resumable session keeps a duplicate of every page fd it got."""
        if not self.resumable:
            return
        with self._lock:
            for pid, fd in zip(ids, fds):
                self._keep_seq += 1
                old = self._keep.get(pid)
                if old is not None:  # re-lent before an earlier Free of it returned
                    fdchannel.close_fds([old[1]])
                self._keep[pid] = (self._keep_seq, os.dup(fd))

    def _on_channel(self, fn):
        """Run a request on the fd channel with the same error handling as _rpc."""
        self._check_state()
        try:
            return fn(self._channel)
        except errors.Unavailable as exc:
            if not self.resumable or self._closed:
                raise
            raise errors.Unavailable(
                f"the daemon is unreachable; session {self.id} resumes when it is back and the pages you hold stay usable ({exc.message})"
            ) from None

    def _allocate_on_channel(self, n: int, device: str, wait: bool, wait_ms: int, notify: bool, timeout: float):
        def run(ch: _Channel):
            req = ch.next_request_id()
            rep = ch.request(fdchannel.encode_allocate(req, n, device, wait, notify, wait_ms), req, timeout)
            ids, fds = ch.receive_all(req | fdchannel.CHANNEL_ALLOC_BIT)
            return rep, ids, fds

        rep, ids, fds = self._on_channel(run)
        dev = self.client.device(device)
        resp = pb.AllocateResponse(allocation_id=rep.req_id | fdchannel.CHANNEL_ALLOC_BIT, device=dev.uuid,
                                   page_size=dev.page_size, page_ids=ids, held_bytes=rep.value)
        self._keep_fds(ids, fds)
        return resp, fds

    def _free_on_channel(self, ids: list[int]) -> int:
        def run(ch: _Channel) -> int:
            n = 0
            for i in range(0, len(ids), fdchannel.MAX_FREE_IDS):
                req = ch.next_request_id()
                n += ch.request(fdchannel.encode_free(req, ids[i : i + fdchannel.MAX_FREE_IDS]), req, self.client.timeout).value
            return n

        return self._on_channel(run)

    def free_ids(self, page_ids: Iterable[int]) -> int:
        """Give pages back. If the daemon is away (UNAVAILABLE) on a
        resumable session, the pages are not claimed when the session
        resumes, which gives them back; the error is still raised so the
        caller knows."""
        ids = list(page_ids)
        with self._lock:
            seen = {i: self._keep[i][0] for i in ids if i in self._keep}
        try:
            if not ids:
                raise errors.InvalidArgument("page_ids is empty: name the pages to free")
            if self.client.channel_requests:
                n = self._free_on_channel(ids)
            else:
                n = self._rpc("Free", pb.FreeRequest(session=self.ref, page_ids=ids)).pages_freed
        except errors.Unavailable:
            if self.resumable:
                with self._lock:
                    self._deferred_free.update(seen)
            raise
        if self.resumable:
            with self._lock:
                for i, seq in seen.items():
                    kept = self._keep.get(i)
                    if kept is not None and kept[0] == seq:
                        fdchannel.close_fds([self._keep.pop(i)[1]])
        return n

    # -- mapped pages
    def allocate(self, num_pages: int, device: str = "", wait: bool = False, wait_timeout_ms: int = 0, notify: bool = False) -> list[Page]:
        """Allocate pages and map them, contiguously, into this process."""
        resp, fds = self.allocate_fds(num_pages, device, wait, wait_timeout_ms, notify)
        mapper = self.mapper(resp.device)
        size = resp.page_size
        res = None
        pages: list[Page] = []
        try:
            res = _Reservation(mapper, size * len(fds))
            for i, (pid, fd) in enumerate(zip(resp.page_ids, fds)):
                addr = res.base + i * size
                token = mapper.map(addr, fd, size)
                fds[i] = -1
                res.live += 1
                pages.append(Page(pid, resp.device, size, addr, mapper, token, res))
        except BaseException:
            fdchannel.close_fds(fd for fd in fds if fd >= 0)
            for p in pages:
                p._unmap()
            if res is not None and res.live == 0:
                mapper.release(res.base, res.size)
            try:
                self.free_ids(resp.page_ids)
            except errors.KVCachedError:
                pass
            raise
        return pages

    def free(self, pages: Iterable[Page | int]) -> int:
        """Unmap (if mapped) and give back pages; all or nothing at the daemon."""
        pages = list(pages)
        ids = [p.id if isinstance(p, Page) else int(p) for p in pages]
        for p in pages:
            if isinstance(p, Page):
                p._unmap()
        return self.free_ids(ids)

    def region(self, size: int, device: str = "") -> "Region":
        from .region import Region  # noqa: F811 - region.py imports this module

        dev = self.client.device(device)
        return Region(self, dev, size)

    # -- information
    def stats(self) -> Stats:
        return Stats.from_pb(self._rpc("GetStats", pb.GetStatsRequest(session=self.ref)))

    def my_stats(self) -> SessionStats:
        for s in self.stats().sessions:
            if s.id == self.id:
                return s
        raise errors.NotFound(f"session {self.id} is not in the daemon's stats")

    def events(self) -> Iterator[Event]:
        """Watch events until the session or the daemon ends. The first is READY."""
        call = self.client._stub.Watch(pb.WatchRequest(session=self.ref))
        self._calls.append(call)
        try:
            for m in call:
                yield Event.from_pb(m)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED and self._closed:
                return
            raise errors.from_rpc_error(exc) from None
        finally:
            if call in self._calls:
                self._calls.remove(call)

    def on_event(self, callback: Callable[[Event], None], kinds: Iterable[str] = ("RECLAIM",)) -> threading.Thread:
        """Run `callback(event)` on a background thread for each event of the
        given kinds (default: reclaim requests). Returns once the stream is
        established. The callback answers a RECLAIM by freeing pages."""
        kinds = set(kinds)
        ready = threading.Event()

        def run() -> None:
            try:
                while not self._closed:
                    try:
                        for ev in self.events():
                            if ev.kind == "READY":
                                ready.set()
                            elif ev.kind in kinds:
                                callback(ev)
                        return  # the stream ended: session closed or daemon shutdown
                    except errors.KVCachedError:
                        # the daemon went away: carry on once the session is resumed
                        time.sleep(0.2)
                        if not self.resumable or not self._resumed.wait(130) or self._state != "ok":
                            return
            finally:
                ready.set()

        t = threading.Thread(target=run, name=f"kvcached-watch-{self.id}", daemon=True)
        t.start()
        ready.wait(self.client.timeout)
        self._watch_threads.append(t)
        return t

    def on_reclaim(self, callback: Callable[[Event], None]) -> threading.Thread:
        return self.on_event(callback, ("RECLAIM",))

    # -- admin
    def set_limits(self, session_id: int, **limits) -> SessionStats:
        req = pb.SetSessionLimitsRequest(admin=self.ref, session_id=session_id, set_fields=list(limits), **limits)
        return SessionStats.from_pb(self._rpc("SetSessionLimits", req).session)

    def request_shrink(self, session_id: int, target_bytes: int, timeout_ms: int = 0) -> int:
        req = pb.RequestShrinkRequest(admin=self.ref, session_id=session_id, target_bytes=target_bytes, timeout_ms=timeout_ms)
        return self._rpc("RequestShrink", req).pages_requested

    # -- life cycle
    def close(self) -> None:
        """End the session; the daemon takes back every page it still holds.
        Pages still mapped here stay readable until unmapped, but they are
        no longer yours: unmap them first."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.client.channel_requests and self._state == "ok":
                ch = self._channel
                req = ch.next_request_id()
                ch.request(fdchannel.encode_close(req), req, self.client.timeout)
            else:
                self._rpc("CloseSession", pb.CloseSessionRequest(session=self.ref))
        except errors.KVCachedError:
            pass  # already ended by the daemon; closing the channel is enough
        finally:
            for call in list(self._calls):
                call.cancel()
            self._channel.close()
            for t in self._watch_threads:
                t.join(timeout=2)
            with self._lock:
                mappers, self._mappers = list(self._mappers.values()), {}
                fdchannel.close_fds(fd for _, fd in self._keep.values())
                self._keep.clear()
            for m in mappers:
                m.close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Client:
    """A connection to kvcached-serve's control socket."""

    def __init__(self, path: str, timeout: float = 10.0, channel_requests: bool | None = None):
        """channel_requests: send Allocate/Free/Close as fd channel requests
        (None = whenever the daemon offers them; False = always gRPC)."""
        self.path = path
        self.timeout = timeout
        self._grpc = grpc.insecure_channel(f"unix:{path}", options=_CHANNEL_OPTIONS)
        try:
            grpc.channel_ready_future(self._grpc).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            self._grpc.close()
            raise errors.Unavailable(f"no kvcached daemon answers on {path} (is kvcached-serve running?)") from None
        self._stub = pb_grpc.KVCachedStub(self._grpc)
        self.info = _call(self._stub.GetInfo, pb.GetInfoRequest(), timeout)
        self.devices = [Device.from_pb(d) for d in self.info.devices]
        offered = self.info.fd_channel_requests
        if channel_requests and not offered:
            raise errors.FailedPrecondition("this daemon does not take requests on the fd channel")
        if channel_requests is False and self.info.fd_channel_requests_only:
            raise errors.FailedPrecondition("this daemon takes Allocate/Free/Close only on the fd channel (channel_ops_only)")
        self.channel_requests = offered if channel_requests is None else channel_requests

    @classmethod
    def connect(cls, path: str | None = None, timeout: float = 10.0, channel_requests: bool | None = None) -> "Client":
        """Connect to `path`, or to the socket named by the environment."""
        return cls(path or socket_from_env(), timeout, channel_requests)

    @classmethod
    def from_env(cls, timeout: float = 10.0) -> "Client":
        return cls(socket_from_env(), timeout)

    def device(self, uuid: str = "") -> Device:
        if not uuid:
            return self.devices[0]
        for d in self.devices:
            if d.uuid == uuid:
                return d
        raise errors.NotFound(f"no device {uuid!r}; the daemon serves {', '.join(d.uuid for d in self.devices)}")

    def open_session(self, name: str, *, guaranteed_bytes: int = 0, max_bytes: int = 0, priority: int = 0, labels: dict[str, str] | None = None) -> Session:
        return Session(self, name, guaranteed_bytes, max_bytes, priority, labels)

    def stats(self) -> Stats:
        return Stats.from_pb(_call(self._stub.GetStats, pb.GetStatsRequest(), self.timeout))

    def close(self) -> None:
        self._grpc.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def socket_from_env() -> str:
    """KVCACHED_SOCKET, then OLLAMA_KVCACHED_SOCKET."""
    for var in ENV_VARS:
        value = os.environ.get(var)
        if value:
            return value
    raise errors.FailedPrecondition(
        "no daemon socket given: pass a path or set KVCACHED_SOCKET (or OLLAMA_KVCACHED_SOCKET) to kvcached-serve's --socket"
    )
