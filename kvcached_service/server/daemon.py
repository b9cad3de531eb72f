"""The daemon: pools, sessions, the fd channel listener and the life cycle.

Everything here runs on one asyncio event loop (the gRPC aio server's). The
gRPC servicer (service.py) translates requests into calls on Daemon and
errors into status codes; it holds no state of its own.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import logging
import os
import secrets
import select
import socket
import stat
import time
from dataclasses import dataclass
from typing import Callable

from .. import errors, fdchannel
from ..backends.base import Backend
from ..config import Settings, format_size, resolve_limit
from .elastic import Reclaimer, pending_pages
from .journal import JSession, Journal
from .pool import DevicePool, Page, PageState, Shortage, continue_page_ids, next_page_id
from .sessions import Channel, ChannelClosed, Session, Tombstones, check_labels, check_name
from .worker import DeviceWorker

log = logging.getLogger("kvcached.daemon")

API_VERSION = 1


@dataclass
class Event:
    """A Watch event before it becomes a protobuf (service.py converts)."""

    kind: str  # READY | RECLAIM | BUDGET_CHANGED | MEMORY_AVAILABLE | SHUTDOWN
    time_unix: float
    data: dict


def prepare_socket_path(path: str) -> None:
    """Refuse to start if another daemon listens on `path`; remove a stale
    socket file nobody listens on; refuse anything that is not a socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise errors.FailedPrecondition(f"socket directory {parent} does not exist")
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise errors.FailedPrecondition(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # stale: nobody listens
        log.info("removed stale socket %s", path)
        return
    except OSError as exc:
        if exc.errno == 91:  # EPROTOTYPE: a SOCK_SEQPACKET listener; try that type
            probe.close()
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            probe.settimeout(1.0)
            try:
                probe.connect(path)
            except (ConnectionRefusedError, FileNotFoundError):
                os.unlink(path)
                return
        else:
            raise
    finally:
        probe.close()
    raise errors.FailedPrecondition(f"another daemon is listening on {path}; refusing to start")


def apply_socket_permissions(path: str, settings: Settings) -> None:
    os.chmod(path, settings.socket_mode_bits)
    gid = settings.socket_gid
    if gid is not None:
        os.chown(path, -1, gid)


class Daemon:
    def __init__(self, settings: Settings, backend: Backend):
        self.settings = settings
        self.backend = backend
        self.pools: dict[str, DevicePool] = {}
        self.workers: list[DeviceWorker] = []
        self.sessions: dict[int, Session] = {}
        self.channels: dict[int, Channel] = {}
        self._unbound: dict[bytes, Channel] = {}
        self.tombstones = Tombstones()
        self._channel_ids = itertools.count(1)
        self._alloc_ids = itertools.count(1)
        self._listener: socket.socket | None = None
        self.started_monotonic = time.monotonic()
        self.shutting_down = False
        self._tasks: set[asyncio.Task] = set()
        # Observers (metrics, the elasticity manager) may hook these.
        self.on_session_end: list[Callable[[Session, str], None]] = []
        # (rpc name, status code number, seconds, waited) for requests served on fd channels
        self.on_request: list[Callable[[str, int, float, bool], None]] = []
        self.counters = {"sessions_opened": 0, "sessions_closed": 0, "sessions_crashed": 0, "fd_channel_errors": 0}
        self.reclaimer = Reclaimer(lambda: list(self.sessions.values()), self._post, settings.reclaim_timeout_ms / 1000)
        # (session, pool uuid, pages): tell the session when that many pages could be had
        self._notify: list[tuple[Session, str, int]] = []
        self.journal: Journal | None = Journal(settings.state_dir) if settings.state_dir else None
        # sessions of a previous daemon, waiting for their clients to resume them
        self.orphans: dict[int, JSession] = {}
        self._orphan_deadline: dict[int, float] = {}
        self._next_session_id = 1

    # ---- start-up -------------------------------------------------------
    def start_devices(self) -> None:
        page_size = self.settings.page_size_bytes
        for spec in self.backend.devices():
            if page_size % spec.granularity:
                raise errors.InvalidArgument(
                    f"page_size {page_size} is not a multiple of device {spec.uuid}'s granularity {spec.granularity}"
                )
            budget = resolve_limit(self.settings.memory_limit, spec.total_bytes)
            if budget < page_size:
                raise errors.InvalidArgument(
                    f"memory_limit {self.settings.memory_limit} gives device {spec.uuid} a budget of {budget} bytes, less than one page ({page_size})"
                )
            worker = DeviceWorker(self.backend, spec.ordinal, spec.uuid[:12])
            worker.start()
            self.workers.append(worker)
            pool = DevicePool(
                self.backend,
                spec,
                worker,
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
                format_size(pool.budget_pages * page_size),
                format_size(spec.total_bytes),
                format_size(page_size),
                pool.warm_pages,
            )

    def recover(self) -> None:
        """Read the journal a previous daemon left: its live sessions become
        orphans whose pages count as in use until their clients resume them
        (ResumeSession) or resume_grace passes. Then start a new journal."""
        if self.journal is None:
            return
        j = self.journal
        j.load()
        self._next_session_id = j.next_session_id
        continue_page_ids(j.next_page_id)
        deadline = time.monotonic() + self.settings.resume_grace
        for js in j.sessions.values():
            for pid, (dev, _) in list(js.pages.items()):
                pool = self.pools.get(dev)
                if pool is None:
                    log.warning("journal: session %d page %d is on device %s, which this daemon does not serve; forgotten", js.sid, pid, dev)
                    del js.pages[pid]
                    continue
                pool.n_held += 1
            self.orphans[js.sid] = js
            self._orphan_deadline[js.sid] = deadline
        j.start(self.orphans, j.next_session_id, j.next_page_id)
        if self.orphans:
            log.info(
                "journal: %d session(s) of the previous daemon (%d pages) wait %gs for their clients to resume them",
                len(self.orphans), sum(len(js.pages) for js in self.orphans.values()), self.settings.resume_grace,
            )

    def _journal(self, rec: dict) -> None:
        j = self.journal
        if j is None:
            return
        j.append(rec)
        live = sum(len(s.pages) + 1 for s in self.sessions.values()) + sum(len(o.pages) + 1 for o in self.orphans.values())
        if j.wants_compaction(live):
            j.compact(self._live_state(), self._next_session_id, next_page_id())

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
        for dev, _ in js.pages.values():
            self.pools[dev].n_held -= 1
        self._journal({"op": "close", "sid": sid})
        self.tombstones.add(sid, reason)
        log.warning("session %d '%s' (uid %d): %s; forgetting its %d pages (their memory stays with whoever still maps them)",
                    sid, js.name, js.uid, reason, len(js.pages))

    async def prefill(self) -> None:
        await asyncio.gather(*(p.prefill() for p in self.pools.values()))

    def start_fd_listener(self) -> None:
        path = self.settings.fd_socket
        prepare_socket_path(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        sock.bind(path)
        apply_socket_permissions(path, self.settings)
        sock.listen(128)
        self._listener = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), self._accept)

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
            self.reclaimer.idle_scan(list(self.pools.values()), self.settings.idle_shrink_seconds)
            for sid in [k for k, t in self._orphan_deadline.items() if t <= now]:
                self._forget_orphan(sid, f"not resumed within {self.settings.resume_grace:g} s of the restart")
            limit = self.settings.channel_bind_timeout
            for ch in [c for c in self._unbound.values() if now - c.created > limit]:
                self._drop_channel(ch, errors.FailedPrecondition(f"no OpenSession within {limit:g} s"))

    # ---- fd channel -----------------------------------------------------
    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self.counters["fd_channel_errors"] += 1
                log.warning("fd channel accept failed: %s", exc)
                return
            try:
                self._admit(conn)
            except Exception:
                self.counters["fd_channel_errors"] += 1
                log.exception("fd channel set-up failed")
                conn.close()

    def _admit(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        pid, uid, gid = fdchannel.peer_credentials(conn)
        ch = Channel(next(self._channel_ids), conn, pid, uid, gid, secrets.token_bytes(fdchannel.SECRET_SIZE))
        refusal = self._refusal(ch)
        if refusal is not None:
            log.warning("refused fd channel from pid %d uid %d: %s", pid, uid, refusal.message)
            ch.send_nowait(fdchannel.encode_error(refusal.code.value[0], refusal.message))
            ch.close()
            return
        if self.shutting_down:
            ch.send_nowait(fdchannel.encode_error(errors.Unavailable.code.value[0], "the daemon is shutting down"))
            ch.close()
            return
        loop = asyncio.get_running_loop()
        self.channels[ch.id] = ch
        self._unbound[ch.secret] = ch
        if pid > 0:
            try:
                ch.pidfd = os.pidfd_open(pid)
                loop.add_reader(ch.pidfd, self._peer_exited, ch)
            except ProcessLookupError:
                self._drop_channel(ch, None, crashed=True)
                return
            except OSError as exc:
                log.debug("pidfd_open(%d) failed: %s; relying on the socket alone", pid, exc)
        loop.add_reader(conn.fileno(), self._channel_readable, ch)
        ch.send_nowait(
            fdchannel.encode_hello(
                fdchannel.Hello(ch.id, pid, uid, gid, fdchannel.MAX_FDS, ch.secret)
            )
        )
        log.debug("fd channel %d: pid %d uid %d gid %d", ch.id, pid, uid, gid)

    def _refusal(self, ch: Channel) -> errors.KVCachedError | None:
        allowed = self.settings.allowed_uids
        if allowed and ch.uid not in allowed and ch.uid != os.getuid():
            return errors.PermissionDenied(f"uid {ch.uid} is not allowed to use this daemon (allowed_uids)")
        per_uid = sum(1 for c in self.channels.values() if c.uid == ch.uid)
        if per_uid >= self.settings.max_sessions_per_uid:
            return errors.ResourceExhausted(
                f"uid {ch.uid} already has {per_uid} fd channels open (max_sessions_per_uid={self.settings.max_sessions_per_uid})"
            )
        if len(self.channels) >= self.settings.max_sessions:
            return errors.ResourceExhausted(f"the daemon already has {len(self.channels)} channels open (max_sessions)")
        return None

    def _channel_readable(self, ch: Channel) -> None:
        """Clients send request records (ALLOCATE, FREE, CLOSE) on a bound
        channel and ADOPT records before ResumeSession; EOF ends the channel.
        Anything else is dropped with its descriptors."""
        try:
            rec = fdchannel.recv_record(ch.sock, fdchannel.MAX_CLIENT_RECORD)
        except (BlockingIOError, InterruptedError):
            return
        except fdchannel.ProtocolError as exc:
            self.counters["fd_channel_errors"] += 1
            log.info("fd channel %d (pid %d): dropped a malformed record: %s", ch.id, ch.pid, exc)
            return
        except OSError:
            rec = None
        if rec is None:
            self._drop_channel(ch, None, crashed=ch.session is not None)
            return
        if isinstance(rec, (fdchannel.AllocateReq, fdchannel.FreeReq, fdchannel.CloseReq)):
            if ch.session is None:
                ch.send_nowait(fdchannel.encode_reply(rec.req_id, errors.FailedPrecondition.code.value[0], 0,
                                                      "no session on this fd channel yet: call OpenSession first"))
            else:
                self._spawn(self._serve_request(ch, ch.session, rec))
            return
        js = self.orphans.get(rec.session_id) if isinstance(rec, fdchannel.Adopt) and ch.session is None else None
        if js is not None and js.uid == ch.uid and (not ch.adopted or ch.adopt_session == rec.session_id):
            # Keep only fds of pages the journal gave this orphan (of this
            # uid): nobody can make the daemon hold descriptors for nothing.
            ch.adopt_session = rec.session_id
            for pid, fd in zip(rec.page_ids, rec.fds):
                old = ch.adopted.pop(pid, None) if pid in js.pages else fd
                if old is not None:
                    fdchannel.close_fds([old])
                if pid in js.pages:
                    ch.adopted[pid] = fd
            return
        fdchannel.close_fds(getattr(rec, "fds", ()))

    async def _serve_request(self, ch: Channel, s: Session, rec) -> None:
        """A request record from a session's own fd channel: the kernel
        vouches for the sender, so no token is needed. Answered with REPLY
        (for ALLOCATE after its PAGES records)."""
        t0 = time.monotonic()
        kind = {fdchannel.AllocateReq: "Allocate", fdchannel.FreeReq: "Free", fdchannel.CloseReq: "CloseSession"}[type(rec)]
        code, value, message = 0, 0, ""
        try:
            if s.closed:
                raise errors.FailedPrecondition(f"session {s.id} is closed")
            if isinstance(rec, fdchannel.AllocateReq):
                _, pool, _ = await self.allocate(s, rec.device, rec.num_pages, rec.wait, rec.wait_timeout_ms, rec.notify,
                                                 alloc_id=rec.req_id | fdchannel.CHANNEL_ALLOC_BIT)
                value = s.held_pages(pool.uuid) * pool.page_size
            elif isinstance(rec, fdchannel.FreeReq):
                value = await self.free(s, list(rec.page_ids))
            else:  # answer first: ending the session closes the channel
                await ch.send(fdchannel.encode_reply(rec.req_id, 0, len(s.pages)), [], self.settings.fd_send_timeout)
                self.end_session(s, "closed by client")
        except ChannelClosed:
            return  # nobody to answer
        except Exception as exc:  # noqa: BLE001 - every failure becomes a REPLY code
            status, message = errors.to_status(exc)
            code = status.value[0]
            if status.name == "INTERNAL":
                log.exception("fd channel %s failed", kind)
        if not isinstance(rec, fdchannel.CloseReq) or code:
            try:
                await ch.send(fdchannel.encode_reply(rec.req_id, code, value, message), [], self.settings.fd_send_timeout)
            except ChannelClosed:
                pass
        for hook in self.on_request:
            hook(kind, code, time.monotonic() - t0, getattr(rec, "wait", False))

    def _peer_exited(self, ch: Channel) -> None:
        self._drop_channel(ch, None, crashed=True)

    def _drop_channel(self, ch: Channel, err: errors.KVCachedError | None, crashed: bool = False) -> None:
        """The channel is gone (EOF, peer exit, error): end its session."""
        if ch.closed:
            return
        if err is not None:
            ch.send_nowait(fdchannel.encode_error(err.code.value[0], err.message))
        if ch.session is not None:
            reason = "client exited" if crashed else (err.message if err else "fd channel closed")
            self.end_session(ch.session, reason, crashed=crashed, goodbye=False)
        self._forget_channel(ch)

    def _forget_channel(self, ch: Channel) -> None:
        self._unbound.pop(ch.secret, None)
        self.channels.pop(ch.id, None)
        ch.close()

    # ---- sessions -------------------------------------------------------
    def open_session(
        self,
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
        if max_bytes and guaranteed_bytes > max_bytes:
            raise errors.InvalidArgument(f"guaranteed_bytes {guaranteed_bytes} exceeds max_bytes {max_bytes}")
        ch = self._unbound_channel(secret)
        if len(self.sessions) >= self.settings.max_sessions:
            raise errors.ResourceExhausted(f"{len(self.sessions)} sessions open (max_sessions)")
        self._check_guarantees(guaranteed_bytes, None)
        del self._unbound[ch.secret]
        resume_token = secrets.token_bytes(32) if self.journal is not None else b""
        s = Session(
            id=self._next_session_id,
            token=secrets.token_bytes(32),
            name=name,
            channel=ch,
            admin=self.settings.is_admin(ch.uid),
            labels=labels,
            guaranteed_bytes=guaranteed_bytes,
            max_bytes=max_bytes,
            priority=priority,
            resume_hash=hashlib.sha256(resume_token).hexdigest() if resume_token else "",
        )
        self._next_session_id += 1
        s.resume_token = resume_token  # handed to the client once, never stored
        ch.session = s
        self.sessions[s.id] = s
        self.counters["sessions_opened"] += 1
        self._journal({"op": "open", "sid": s.id, "uid": s.uid, "name": name, "rh": s.resume_hash,
                       "g": guaranteed_bytes, "m": max_bytes, "p": priority, "labels": labels})
        log.info("session %d '%s' opened by pid %d uid %d%s", s.id, name, s.pid, s.uid, " (admin)" if s.admin else "")
        return s

    def _unbound_channel(self, secret: bytes) -> Channel:
        if len(secret) != fdchannel.SECRET_SIZE:
            raise errors.InvalidArgument(f"channel_secret must be {fdchannel.SECRET_SIZE} bytes from the fd channel's HELLO, got {len(secret)}")
        for candidate_secret, candidate in self._unbound.items():
            if hmac.compare_digest(candidate_secret, secret) and not candidate.closed:
                return candidate
        raise errors.FailedPrecondition("unknown or already used channel secret: connect the fd channel and use the secret from its HELLO")

    async def resume_session(self, secret: bytes, sid: int, token: bytes, page_ids: list[int]) -> tuple[Session, int, int]:
        """Re-attach a session of the previous daemon to a new fd channel,
        adopting the pages its client re-sent (ADOPT) after checking the
        claim against the journal. Returns (session, adopted, forgotten)."""
        self._check_serving()
        if self.journal is None:
            raise errors.FailedPrecondition("this daemon keeps no journal (--state-dir), so sessions cannot be resumed; open a new one")
        ch = self._unbound_channel(secret)
        # the client sent its ADOPT records before this call: read them all now
        while not ch.closed and ch.sock.fileno() >= 0:
            before = len(ch.adopted)
            try:
                select_ready = bool(select.select([ch.sock], [], [], 0)[0])
            except (OSError, ValueError):
                break
            if not select_ready:
                break
            self._channel_readable(ch)
            if len(ch.adopted) == before and not select.select([ch.sock], [], [], 0)[0]:
                break
        if ch.closed:
            raise errors.FailedPrecondition("the fd channel closed before ResumeSession")
        js = self.orphans.get(sid)
        if js is None:
            if sid in self.sessions:
                raise errors.FailedPrecondition(f"session {sid} is live; only a session of a previous daemon can be resumed")
            reason = self.tombstones.get(sid)
            raise errors.NotFound(f"no session {sid} to resume" + (f" ({reason})" if reason else " in the journal"))
        if not hmac.compare_digest(hashlib.sha256(token).hexdigest(), js.resume_hash):
            raise errors.PermissionDenied(f"resume token does not match session {sid}")
        if ch.uid != js.uid:
            raise errors.PermissionDenied(f"session {sid} belonged to uid {js.uid}, not to uid {ch.uid}")
        if len(set(page_ids)) != len(page_ids):
            raise errors.InvalidArgument("page_ids repeats a page; nothing was adopted")
        if ch.adopted and ch.adopt_session != sid:
            raise errors.InvalidArgument(f"the ADOPT records on this channel name session {ch.adopt_session}, not {sid}")
        for pid in page_ids:
            if pid not in js.pages:
                raise errors.PermissionDenied(f"page {pid} was not held by session {sid}; nothing was adopted")
            if pid not in ch.adopted:
                raise errors.InvalidArgument(f"page {pid} is claimed but its fd was not sent as ADOPT; nothing was adopted")
        for pid in page_ids:
            if self.backend.identity(ch.adopted[pid]) != js.pages[pid][1]:
                raise errors.PermissionDenied(f"the fd sent for page {pid} is not the page the journal recorded; nothing was adopted")
        by_dev: dict[str, list[int]] = {}
        for pid in page_ids:
            by_dev.setdefault(js.pages[pid][0], []).append(pid)
        adopted: dict[int, tuple[str, object]] = {}
        for dev, pids in by_dev.items():
            pool = self.pools[dev]
            fds = [ch.adopted.pop(pid) for pid in pids]
            try:
                handles = await pool.worker.call(self.backend.adopt_pages, pool.spec.ordinal, fds, pool.page_size)
            except BaseException:
                # undo earlier devices: the orphan keeps its pages, the client may retry
                for d2, h in adopted.values():
                    await self.pools[d2].worker.call(self.backend.release_pages, self.pools[d2].spec.ordinal, [h])
                raise
            for pid, h in zip(pids, handles):
                adopted[pid] = (dev, h)
        fdchannel.close_fds(ch.adopted.values())
        ch.adopted.clear()
        if sid not in self.orphans or ch.closed:  # lost a race with the grace timer or the client
            for dev, h in adopted.values():
                await self.pools[dev].worker.call(self.backend.release_pages, self.pools[dev].spec.ordinal, [h])
            raise errors.FailedPrecondition(f"session {sid} could not be resumed: it expired or its channel closed meanwhile")
        del self.orphans[sid]
        self._orphan_deadline.pop(sid, None)
        del self._unbound[ch.secret]
        s = Session(
            id=sid, token=secrets.token_bytes(32), name=js.name, channel=ch, admin=self.settings.is_admin(ch.uid),
            labels=dict(js.labels), guaranteed_bytes=js.guaranteed_bytes, max_bytes=js.max_bytes,
            priority=js.priority, resume_hash=js.resume_hash,
        )
        ch.session = s
        self.sessions[sid] = s
        forgotten = [pid for pid in js.pages if pid not in adopted]
        for pid in forgotten:
            self.pools[js.pages[pid][0]].n_held -= 1
        by_pool: dict[str, list[Page]] = {}
        for pid, (dev, h) in adopted.items():
            page = Page(id=pid, device=dev, handle=h, state=PageState.HELD, session=s, uid=s.uid, ident=js.pages[pid][1])
            self.pools[dev].pages[pid] = page
            by_pool.setdefault(dev, []).append(page)
        for dev, pages in by_pool.items():
            s.add_pages(self.pools[dev], pages)
        if forgotten:
            self._journal({"op": "free", "sid": sid, "pages": forgotten})
        self.counters["sessions_resumed"] = self.counters.get("sessions_resumed", 0) + 1
        log.info("session %d '%s' resumed by pid %d uid %d: %d pages adopted, %d forgotten",
                 sid, s.name, s.pid, s.uid, len(adopted), len(forgotten))
        return s, len(adopted), len(forgotten)

    def _check_guarantees(self, guaranteed_bytes: int, exclude: Session | None) -> None:
        if not guaranteed_bytes:
            return
        for pool in self.pools.values():
            budget = pool.budget_pages * pool.page_size
            total = sum(s.guaranteed_bytes for s in self.sessions.values() if s is not exclude) + guaranteed_bytes
            if total > budget:
                raise errors.ResourceExhausted(
                    f"guarantees would total {format_size(total)}, more than device {pool.uuid}'s budget {format_size(budget)}"
                )

    def session(self, ref_id: int, token: bytes) -> Session:
        """The session a request names; checks the token."""
        if not ref_id:
            raise errors.InvalidArgument("session is required (SessionRef with id and token)")
        s = self.target_session(ref_id)
        if not hmac.compare_digest(s.token, token):
            raise errors.PermissionDenied(f"token does not match session {ref_id}")
        return s

    def admin_session(self, ref_id: int, token: bytes) -> Session:
        s = self.session(ref_id, token)
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

    def shrinker_session(self, ref_id: int, token: bytes, target_sid: int) -> Session:
        """The session a RequestShrink comes from: an admin, or a session of
        the target's own uid (asking one's own processes to give memory back
        needs no more than the uid already has)."""
        s = self.session(ref_id, token)
        if s.admin:
            return s
        target = self.target_session(target_sid)
        if target.uid != s.uid:
            raise errors.PermissionDenied(
                f"session {s.id} (uid {s.uid}) may only shrink sessions of its own uid "
                f"(session {target_sid} is uid {target.uid}) unless it is an admin session (admin_uids)")
        return s

    def end_session(self, s: Session, reason: str, *, crashed: bool = False, goodbye: bool = True) -> int:
        """End a session: its pages go back to the pool (zeroed for their
        uid), its watchers stop, its channel closes. Returns pages returned."""
        if s.closed:
            return 0
        s.closed = True
        self.sessions.pop(s.id, None)
        self.tombstones.add(s.id, reason)
        self.counters["sessions_crashed" if crashed else "sessions_closed"] += 1
        if not self.shutting_down:
            self._journal({"op": "close", "sid": s.id})
        by_pool: dict[str, list[Page]] = {}
        for page in s.pages.values():
            by_pool.setdefault(page.device, []).append(page)
        n = len(s.pages)
        for uuid, pages in by_pool.items():
            pool = self.pools[uuid]
            s.remove_pages(pool, pages)
            self._spawn(pool.give_back(pages))
        for q in s.watchers:
            q.put_nowait(None)
        ch = s.channel
        if goodbye and not ch.closed:
            ch.send_nowait(fdchannel.encode_goodbye())
        self._forget_channel(ch)
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

    async def allocate(self, s: Session, device: str, count: int, wait: bool, wait_ms: int, notify: bool = False,
                       alloc_id: int | None = None) -> tuple[int, DevicePool, list[Page]]:
        self._check_serving()
        limit = self.settings.max_pages_per_request
        if count <= 0 or count > limit:
            raise errors.InvalidArgument(f"num_pages must be 1..{limit}, got {count}")
        pool = self.pool(device)
        cap = pool.budget_pages if not s.max_bytes else min(pool.budget_pages, s.max_bytes // pool.page_size)
        held = s.held_pages(pool.uuid)
        if held + count > cap:
            raise errors.ResourceExhausted(
                f"session {s.id} '{s.name}' holds {held} pages on {pool.uuid}; {count} more would exceed its maximum of {cap} pages"
                + (f" (max_bytes {format_size(s.max_bytes)})" if s.max_bytes else " (the device budget)")
            )
        pages = await self._acquire(s, pool, count, wait, wait_ms, notify)
        if s.closed:
            # The session ended while its pages were being made: nobody got them.
            await pool.give_back(pages)
            raise errors.FailedPrecondition(f"session {s.id} closed while allocating")
        s.add_pages(pool, pages)
        if self.journal is not None:
            for p in pages:
                if not p.ident:
                    p.ident = self.backend.identity(p.handle.fd)
            self._journal({"op": "alloc", "sid": s.id, "dev": pool.uuid, "pages": [[p.id, p.ident] for p in pages]})
        if alloc_id is None:
            alloc_id = next(self._alloc_ids)
        try:
            await self._deliver(s, alloc_id, pages)
        except ChannelClosed as exc:
            self.counters["fd_channel_errors"] += 1
            err = errors.Unavailable(f"could not deliver pages on session {s.id}'s fd channel: {exc}")
            self._drop_channel(s.channel, err)
            if not s.closed:
                self.end_session(s, str(exc))
            raise err from None
        except asyncio.CancelledError:
            # The caller gave up (its deadline passed) before the answer: it
            # never learns these page ids, so the session must not keep them.
            if not s.closed and all(p.id in s.pages for p in pages):
                s.remove_pages(pool, pages)
                self._journal({"op": "free", "sid": s.id, "pages": [p.id for p in pages]})
                self._spawn(pool.give_back(pages))
            raise
        pool.mark_held(pages)
        s.allocations_total += 1
        s.touch()
        return alloc_id, pool, pages

    async def _acquire(self, s: Session, pool: DevicePool, count: int, wait: bool, wait_ms: int, notify: bool) -> list[Page]:
        """pool.acquire, and when memory is short and the caller may wait:
        ask other sessions for pages (elastic.Reclaimer) and retry each time
        pages come back, until the deadline."""
        loop = asyncio.get_running_loop()
        wait_s = (wait_ms or self.settings.default_wait_ms) / 1000
        deadline = loop.time() + wait_s
        asked: dict[int, tuple[Session, int, int]] = {}  # id -> (session, pages asked, held when first asked)
        while True:
            try:
                return await pool.acquire(s, count)
            except Shortage as short:
                now = loop.time()
                if not wait or now >= deadline:
                    pool.counters.allocation_failures_total += 1
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

    async def _deliver(self, s: Session, alloc_id: int, pages: list[Page]) -> None:
        total = len(pages)
        step = fdchannel.MAX_FDS
        for first in range(0, total, step):
            chunk = pages[first : first + step]
            rec = fdchannel.encode_pages(alloc_id, first, total, [p.id for p in chunk])
            await s.channel.send(rec, [p.handle.fd for p in chunk], self.settings.fd_send_timeout)

    async def free(self, s: Session, page_ids: list[int]) -> int:
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
            self.reclaimer.settle(s, uuid, len(group))
        s.frees_total += 1
        s.touch()
        self._journal({"op": "free", "sid": s.id, "pages": [p.id for p in pages]})
        # Tasks of their own: a cancelled Free (its client died) still returns the pages.
        await asyncio.wait([self._spawn(self.pools[u].give_back(g)) for u, g in by_pool.items()])
        return len(pages)

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
        if m and g > m:
            raise errors.InvalidArgument(f"guaranteed_bytes {g} exceeds max_bytes {m}")
        self._check_guarantees(g, s)
        s.guaranteed_bytes, s.max_bytes = g, m
        s.priority = fields.get("priority", s.priority)
        self._journal({"op": "limits", "sid": s.id, "g": s.guaranteed_bytes, "m": s.max_bytes, "p": s.priority})
        for pool in self.pools.values():
            s.post(Event("BUDGET_CHANGED", time.time(), {
                "device": pool.uuid, "budget_bytes": pool.budget_pages * pool.page_size,
                "guaranteed_bytes": s.guaranteed_bytes, "max_bytes": s.max_bytes, "priority": s.priority}))
        log.info("session %d '%s' limits: guaranteed %d, max %d, priority %d", s.id, s.name, g, m, s.priority)
        return s

    def request_shrink(self, sid: int, target_bytes: int, timeout_ms: int, reason: str) -> int:
        """Ask a session (through Watch) to hold at most target_bytes per
        device, never below its guarantee. Returns pages asked for."""
        s = self.target_session(sid)
        timeout = (timeout_ms or self.settings.reclaim_timeout_ms) / 1000
        asked = 0
        for pool in self.pools.values():
            keep = max(target_bytes, s.guaranteed_bytes) // pool.page_size
            extra = s.held_pages(pool.uuid) - keep - pending_pages(s, pool, time.time())
            if extra > 0:
                asked += extra
                self.reclaimer.ask(s, pool, extra, time.time() + timeout, reason)
        return asked

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
        """Tell every session, stop accepting, wait out the grace period (or
        until every session has gone)."""
        self.shutting_down = True
        loop = asyncio.get_running_loop()
        if self._listener is not None:
            loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
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
        for s in list(self.sessions.values()):
            s.channel.send_nowait(fdchannel.encode_error(errors.Unavailable.code.value[0], "the daemon is shutting down"))
            self.end_session(s, "daemon shutdown", goodbye=False)
        for ch in list(self.channels.values()):
            self._drop_channel(ch, errors.Unavailable("the daemon is shutting down"))
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
        try:
            os.unlink(self.settings.fd_socket)
        except FileNotFoundError:
            pass
        if failures:
            raise ShutdownIncomplete("; ".join(failures))


class ShutdownIncomplete(Exception):
    """Shutdown finished but could not release everything (the message says what)."""
