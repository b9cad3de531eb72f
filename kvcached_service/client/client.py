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

The client is split by concern:
- client.py (this module): Client and Session, the public API, and mapped
  Pages;
- channel.py: the fd channel (page requests, PAGES, REPLY, hang-up);
- resume.py: what a resumable session keeps, and the resume loop;
- rpc.py: the gRPC adapter (the only module importing grpc or protobuf);
- types.py: the value types the API returns.
Page operations (Allocate, Free, Close) go on the session's fd channel only;
gRPC carries GetInfo, OpenSession, ResumeSession, GetStats, Watch and the
admin rpcs. Every failed call raises a subclass of
kvcached_service.errors.KVCachedError.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

from .. import errors, fdchannel
from .channel import Channel
from .mapping import Mapper, keep_handles_limit, mapper_for
from .resume import Keeper, Resumer
from .rpc import Rpc, WatchStream
from .types import Allocation, Device, Event, Info, Opened, PoolStats, ReclaimOutcome, SessionStats, Shrink, Stats

if TYPE_CHECKING:
    from .region import Region

ENV_VARS = ("OLLAMA_KVCACHED_SOCKET", "KVCACHED_SOCKET")  # one order in every client: docs/operations.md

log = logging.getLogger("kvcached.client")

__all__ = ["Allocation", "Client", "Device", "Event", "Info", "Page", "PoolStats", "ReclaimOutcome", "Session", "SessionStats", "Shrink",
           "Stats", "socket_from_env"]


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
        self._channel = Channel(client.info.fd_socket, client.timeout, self._hangup, self._drop_kept)
        try:
            opened = client._rpc.open_session(self._channel.hello.secret, name, guaranteed_bytes, max_bytes, priority, labels)
        except BaseException:
            self._channel.close()
            raise
        self.id = opened.id
        self.token = opened.token  # a bearer secret for gRPC: never log or share it
        self.pid, self.uid, self.gid, self.admin = opened.pid, opened.uid, opened.gid, opened.admin
        self._mappers: dict[str, Mapper] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._watch_threads: list[threading.Thread] = []
        self._streams: list[WatchStream] = []
        # Resume after a daemon restart (the daemon keeps a journal).
        self.resume_token = opened.resume_token
        self.resumable = bool(opened.resume_token)
        self._keeper: Keeper | None = Keeper() if self.resumable else None
        self._state = "ok"  # ok | resuming | dead
        self._dead: errors.KVCachedError | None = None
        self._resumed = threading.Event()
        self._resumed.set()
        self.resumes = 0
        # page requests in flight (see _request_begins)
        self._inflight = 0
        self._inflight_lock = threading.Lock()
        # held pages kept as standby (standby_ids; a use or a free ends it): said again to a restarted daemon
        self._standby: set[int] = set()

    # -- plumbing
    def _ref(self) -> tuple[int, bytes]:
        return self.id, self.token

    @property
    def resuming(self) -> bool:
        """True while the daemon is away and the session is being resumed."""
        return self._state == "resuming"

    def _check_state(self) -> None:
        if self._state == "resuming":
            raise errors.Unavailable(f"the daemon went away; session {self.id} is being resumed: the pages you hold stay usable, try again shortly")
        if self._state == "dead":
            raise self._dead  # type: ignore[misc]

    def _ended_by_hangup(self) -> errors.FailedPrecondition:
        return errors.FailedPrecondition(
            f"session {self.id} ended: the daemon went away, and without a state dir (kvcached-serve --state-dir) "
            "a daemon that restarts cannot resume it; open a new session")

    def _unreachable(self, exc: errors.Unavailable, ch: Channel | None = None) -> errors.KVCachedError:
        """UNAVAILABLE because the daemon went away: say that the session
        resumes (when it does: resumable, and the channel hung up). A session
        that cannot resume ended with its channel: a terminal error."""
        if not self.resumable and not self._closed and ch is not None and ch.hung_up:
            return self._dead or self._ended_by_hangup()
        if not self.resumable or self._closed or (ch is not None and ch.ended is not None and not ch.hung_up):
            return exc
        return errors.Unavailable(
            f"the daemon is unreachable; session {self.id} resumes when it is back and the pages you hold stay usable ({exc.message})"
        )

    def _rpc(self, fn: Callable[[], object]):
        """A gRPC call of this session, with the same error handling as the channel's."""
        self._check_state()
        try:
            return fn()
        except errors.Unavailable as exc:
            raise self._unreachable(exc) from None

    def _on_channel(self, fn: Callable[[Channel], object]):
        """Run a page request on the current fd channel."""
        self._check_state()
        ch = self._channel
        try:
            return fn(ch)
        except errors.Unavailable as exc:
            raise self._unreachable(exc, ch) from None

    def _request_begins(self) -> None:
        """A page request is in flight: a resume waits until none is (see
        _connect_for_resume), so that what they did (pages kept, frees
        deferred) is settled before it claims what the session holds."""
        with self._inflight_lock:
            self._inflight += 1

    def _request_ends(self) -> None:
        with self._inflight_lock:
            self._inflight -= 1

    # -- resume after a daemon restart
    def _hangup(self, ch: Channel) -> None:
        """The fd channel hung up (reader thread). A resumable session
        resumes on a thread of its own; any other session is over: every
        later call fails with FAILED_PRECONDITION "session N ended: ...",
        never a retryable UNAVAILABLE (docs/protocol.md, Client semantics)."""
        if self._closed or ch is not self._channel:
            return
        # The daemon that recorded our kept handles is gone: let them go (a
        # restarted daemon's page ids promise nothing about the old pages).
        self._drop_kept(None)
        if not self.resumable:
            self._dead = self._ended_by_hangup()
            self._state = "dead"
            log.warning("%s", self._dead.message)
            return
        self._state = "resuming"
        self._resumed.clear()
        assert self._keeper is not None
        Resumer(self.id, self.resume_token, self._keeper, self.client._rpc, self.client.info.fd_socket, self.client.timeout,
                connect=self._connect_for_resume, done=self._resume_done, closed=lambda: self._closed).start()

    def _after_resume(self, ch: Channel, late: dict[int, int], standby: list[int]) -> None:
        """On the new channel: free the pages freed while the resume was in
        flight (so adopted), and keep as standby again those that were."""
        if late:
            try:
                ch.free(sorted(late), self.client.timeout)
                self._keeper.forget(late)  # type: ignore[union-attr]
            except errors.KVCachedError as exc:
                log.warning("session %d: freeing %d pages released during the resume failed: %s", self.id, len(late), exc.message)
        standby = [pid for pid in standby if pid in self._standby]  # not taken back meanwhile
        if standby:
            try:
                ch.free(standby, self.client.timeout, standby=True)
            except errors.KVCachedError as exc:  # they stay in use in the books: correct, only not asked for first
                log.warning("session %d: keeping %d pages as standby again after the resume failed: %s", self.id, len(standby),
                            exc.message)

    def _connect_for_resume(self) -> Channel:
        ch = Channel(self.client.info.fd_socket, self.client.timeout, self._hangup, self._drop_kept)
        # Page requests of the old channel settle first (pages kept, frees
        # deferred): they fail or finish at once, its channel has ended.
        deadline = time.monotonic() + self.client.timeout
        while self._inflight and time.monotonic() < deadline:
            time.sleep(0.005)
        return ch

    def _resume_done(self, ch: Channel | None, opened: Opened | None, err: errors.KVCachedError | None) -> None:
        if ch is None:
            if err is not None:
                self._dead = err
                self._state = "dead"
            self._resumed.set()
            return
        assert opened is not None and self._keeper is not None
        if self._closed:
            ch.close()  # the daemon ends the session when its channel closes
            self._resumed.set()
            return
        old, self._channel = self._channel, ch
        old.on_hangup = None
        old.close()
        self.token = opened.token
        self.resumes += 1
        self._state = "ok"
        self._resumed.set()
        late = self._keeper.late()
        # standby pages the restarted daemon adopted: its books say so again (it does not journal standby)
        standby = sorted((self._standby & self._keeper.ids()) - set(late)) if self.client.info.fd_channel_standby else []
        if late or standby:
            threading.Thread(target=self._after_resume, args=(ch, late, standby), name=f"kvcached-after-resume-{self.id}",
                             daemon=True).start()
        if ch.ended is not None and ch.hung_up:  # the daemon went away again before the swap
            self._hangup(ch)

    def wait_resumed(self, timeout: float | None = None) -> bool:
        """Block until the session is usable again after a daemon restart."""
        return self._resumed.wait(timeout) and self._state == "ok"

    def mapper(self, device: str) -> Mapper:
        with self._lock:
            m = self._mappers.get(device)
            if m is None:
                m = mapper_for(self.client.device(device).kind, device)
                if self.client.info.fd_channel_keep_handles:
                    m.keep_handles(keep_handles_limit())
                self._mappers[device] = m
            return m

    def _drop_kept(self, page_ids: list[int] | None) -> None:
        """Let kept handles go: of these pages (a DROP), or all (None: the
        session's daemon went away)."""
        with self._lock:
            mappers = list(self._mappers.values())
        for m in mappers:
            try:
                m.drop_kept(page_ids)
            except Exception as exc:  # noqa: BLE001 - the reader thread must go on
                log.warning("session %d: releasing kept handles failed: %s", self.id, exc)

    def _keeps_any(self, page_ids: list[int]) -> bool:
        with self._lock:
            mappers = list(self._mappers.values())
        return any(m.keeps_any(page_ids) for m in mappers)

    # -- raw pages (fds; the caller maps them)
    def allocate_fds(self, num_pages: int, device: str = "", wait: bool = False, wait_timeout_ms: int = 0, notify: bool = False) -> tuple[Allocation, list[int]]:
        """Allocate and return the answer and one fd per page (caller
        closes). wait: let the daemon reclaim from other sessions for up to
        wait_timeout_ms (0 = its default). notify: if it fails for lack of
        memory, get a MEMORY_AVAILABLE event when enough pages are free."""
        timeout = self.client.timeout + ((wait_timeout_ms or 60_000) / 1000 if wait else 0)
        self._request_begins()
        try:
            alloc_id, held, ids, fds = self._on_channel(lambda ch: ch.allocate(num_pages, device, wait, notify, wait_timeout_ms, timeout))
            dev = self.client.device(device)
            if self._keeper is not None:
                self._keeper.keep(ids, fds)
        finally:
            self._request_ends()
        return Allocation(alloc_id, dev.uuid, dev.page_size, tuple(ids), held), fds

    def free_ids(self, page_ids: Iterable[int]) -> int:
        """Give pages back; all or nothing. On a resumable session whose
        daemon is away (or goes away before answering), the Free succeeds
        at once: the pages are not claimed when the session resumes, so the
        restarted daemon takes them back (docs/protocol.md, "Client
        semantics")."""
        ids = list(page_ids)
        if not ids:
            raise errors.InvalidArgument("page_ids is empty: name the pages to free")
        if self._closed:
            raise errors.FailedPrecondition(f"session {self.id} is closed")
        k = self._keeper
        self._request_begins()
        try:
            seqs = k.seqs(ids) if k is not None else {}
            if k is not None and self._state == "resuming":
                return self._defer(ids, seqs)
            self._check_state()
            ch = self._channel
            try:
                n = ch.free(ids, self.client.timeout, self._keeps_any(ids))
            except errors.Unavailable as exc:
                if k is not None and ch.hung_up and not self._closed:
                    return self._defer(ids, seqs)
                raise self._unreachable(exc, ch) from None
            if k is not None:
                k.forget(seqs)
            self._standby.difference_update(ids)
            return n
        finally:
            self._request_ends()

    def standby_ids(self, page_ids: Iterable[int]) -> int:
        """Keep held pages as standby (still this session's, still mapped
        here; a reclaim asks for them first): a FREE with the standby flag.
        All or nothing, checked as a Free. Returns pages named."""
        ids = list(page_ids)
        if not ids:
            raise errors.InvalidArgument("page_ids is empty: name the pages to keep as standby")
        if not self.client.info.fd_channel_standby:
            raise errors.FailedPrecondition(f"kvcached-serve {self.client.info.version} keeps no standby pages (GetInfo().fd_channel_standby is false)")
        self._check_state()
        self._request_begins()
        try:
            n = self._on_channel(lambda ch: ch.free(ids, self.client.timeout, standby=True))
        finally:
            self._request_ends()
        self._standby.update(ids)
        return n

    def use_ids(self, page_ids: Iterable[int]) -> None:
        """Standby pages in use again (USE, not waited for)."""
        ids = list(page_ids)
        self._standby.difference_update(ids)
        if ids and self._state == "ok":
            self._channel.send_use(ids)

    def _defer(self, ids: list[int], seqs: dict[int, int]) -> int:
        """Free while the daemon is away: checked here as the daemon would
        (all or nothing), then deferred (resume.Keeper.defer)."""
        assert self._keeper is not None
        seen: set[int] = set()
        for pid in ids:
            if pid in seen:
                raise errors.InvalidArgument(f"page {pid} appears more than once; nothing was freed")
            seen.add(pid)
        missing = self._keeper.not_held(ids)
        if missing:
            raise errors.NotFound(f"page {missing[0]} is not held by session {self.id}; nothing was freed")
        self._keeper.defer(seqs)
        self._standby.difference_update(ids)  # given back, as a Free the daemon answered
        return len(ids)

    # -- mapped pages
    def allocate(self, num_pages: int, device: str = "", wait: bool = False, wait_timeout_ms: int = 0, notify: bool = False) -> list[Page]:
        """Allocate pages and map them, contiguously, into this process."""
        a, fds = self.allocate_fds(num_pages, device, wait, wait_timeout_ms, notify)
        mapper = self.mapper(a.device)
        size = a.page_size
        res = None
        pages: list[Page] = []
        try:
            res = _Reservation(mapper, size * len(fds))
            run_fds = list(fds)
            fds[:] = [-1] * len(fds)  # map_run closes them, whatever happens
            tokens = mapper.map_run(res.base, run_fds, size, list(a.page_ids))
            for i, (pid, token) in enumerate(zip(a.page_ids, tokens)):
                res.live += 1
                pages.append(Page(pid, a.device, size, res.base + i * size, mapper, token, res))
        except BaseException:
            fdchannel.close_fds(fd for fd in fds if fd >= 0)
            for p in pages:
                p._unmap()
            if res is not None and res.live == 0:
                mapper.release(res.base, res.size)
            try:
                self.free_ids(a.page_ids)
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
        return self._rpc(lambda: self.client._rpc.stats(self._ref()))

    def my_stats(self) -> SessionStats:
        for s in self.stats().sessions:
            if s.id == self.id:
                return s
        raise errors.NotFound(f"session {self.id} is not in the daemon's stats")

    def events(self) -> Iterator[Event]:
        """Watch events until the session or the daemon ends. The first is READY."""
        stream = self.client._rpc.watch(self._ref())
        self._streams.append(stream)
        try:
            yield from stream
        finally:
            if stream in self._streams:
                self._streams.remove(stream)

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
        return self._rpc(lambda: self.client._rpc.set_limits(self._ref(), session_id, **limits))

    def request_shrink(self, session_id: int, target_bytes: int, timeout_ms: int = 0) -> int:
        """Ask a session (an admin may ask any; others only their own uid's)
        to hold at most target_bytes per device. Returns the pages asked for;
        see shrink() to wait for the outcome."""
        return self._rpc(lambda: self.client._rpc.request_shrink(self._ref(), session_id, target_bytes, timeout_ms).pages_requested)

    def shrink(self, session_id: int, target_bytes: int, timeout_ms: int = 0, wait: bool = True) -> Shrink:
        """request_shrink, and (wait) return once the session answered, gave
        the pages back, ended, or the deadline passed: each request's
        outcome, with what the session said it gave and keeps, and why."""
        return self._rpc(lambda: self.client._rpc.request_shrink(self._ref(), session_id, target_bytes, timeout_ms, wait))

    def answer_reclaim(self, request: Event | int, bytes_given: int, bytes_kept: int, reason: str = "") -> int:
        """Answer a reclaim request (a RECLAIM event, or its reclaim_id) at
        once: the bytes given back for it (already freed) and the bytes kept
        on its device, with why. The request is settled: not counted as
        ignored, nobody waits for the rest, and a waiting `kvcachedctl
        shrink` prints the answer. Sent on the session's fd channel (the
        kernel names the sender). Returns the bytes the daemon's books show
        this session holding on that device."""
        rid = request.reclaim_id if isinstance(request, Event) else int(request)
        if rid <= 0:
            raise errors.InvalidArgument("answer_reclaim needs a RECLAIM event (or its reclaim_id) from this session's Watch stream")
        return self._on_channel(lambda ch: ch.answer(rid, bytes_given, bytes_kept, reason, self.client.timeout))

    # -- life cycle
    def close(self) -> None:
        """End the session; the daemon takes back every page it still holds.
        Pages still mapped here stay readable until unmapped, but they are
        no longer yours: unmap them first."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._state == "ok":
                self._channel.close_session(self.client.timeout)
        except errors.KVCachedError:
            pass  # already ended by the daemon; closing the channel is enough
        finally:
            for stream in list(self._streams):
                stream.cancel()
            self._channel.close()
            for t in self._watch_threads:
                t.join(timeout=2)
            with self._lock:
                mappers, self._mappers = list(self._mappers.values()), {}
            if self._keeper is not None:
                self._keeper.close()
            for m in mappers:
                m.close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Client:
    """A connection to kvcached-serve."""

    def __init__(self, path: str, timeout: float = 10.0):
        self.path = path
        self.timeout = timeout
        self._rpc = Rpc(path, timeout)
        try:
            self.info: Info = self._rpc.get_info()
            if not self.info.fd_channel_requests:
                raise errors.FailedPrecondition(
                    f"the daemon on {path} does not take page requests on the fd channel (kvcached-serve {self.info.version} is too old for this client)")
        except BaseException:
            self._rpc.close()
            raise
        self.devices: list[Device] = list(self.info.devices)

    @classmethod
    def connect(cls, path: str | None = None, timeout: float = 10.0) -> "Client":
        """Connect to `path`, or to the socket named by the environment."""
        return cls(path or socket_from_env(), timeout)

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
        return self._rpc.stats()

    def close(self) -> None:
        self._rpc.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def socket_from_env() -> str:
    """OLLAMA_KVCACHED_SOCKET, then KVCACHED_SOCKET (as the Go and C clients)."""
    for var in ENV_VARS:
        value = os.environ.get(var)
        if value:
            return value
    raise errors.FailedPrecondition(
        "no daemon socket given: pass a path or set OLLAMA_KVCACHED_SOCKET or KVCACHED_SOCKET to kvcached-serve's --socket"
    )
