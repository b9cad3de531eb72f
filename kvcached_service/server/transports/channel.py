"""The fd channel adapter: records in, Daemon calls, records out.

The gRPC adapter (service.py) and this one sit side by side in front of the
core (daemon.py). This one owns everything about the fd channel's socket
(docs/protocol.md):

- the listener and admission of a connection: SO_PEERCRED names the peer,
  the uid allow-list and the per-uid / total channel limits are checked, a
  pidfd watches the peer process, HELLO carries the one-time secret;
- channels not bound to a session yet, found by that secret when
  OpenSession / ResumeSession arrive over gRPC (the core sees this adapter
  as its PortDirectory); a channel left unbound for channel_bind_timeout is
  closed;
- each bound channel is its session's SessionPort (`Conn`): it delivers
  pages as PAGES records and hangs up with GOODBYE or ERROR;
- an ALLOCATE on a channel is lent by the core (`Daemon.lend`: pages booked
  to the session, and journaled, before any client can hold them); this
  adapter then sends the PAGES records itself, closes fresh exports, and
  answers; a loan it could not deliver goes back (`Daemon.undelivered`);
- request records (ALLOCATE, FREE, CLOSE, ANSWER) become core calls,
  answered by REPLY; each handler runs at once on the read callback's stack
  (`eager_start`) and becomes a Task only if it must wait; ADOPT records are collected per channel as (page id, fd) pairs for
  ResumeSession;
- hang-up: EOF, or the peer process exiting, ends the session.

A record that does not follow the wire spec gets one of two answers
(protos/kvcached/v1/fdchannel.spec.json):
- a request record whose framing is sound and whose req_id can be read
  (a FREE whose count does not match its length, an ALLOCATE with a wrong
  device_len, a CLOSE of 9 bytes, descriptors on a request, a request cut
  because it is larger than any a client sends): REPLY INVALID_ARGUMENT
  naming the fault; the session goes on ("on_malformed_request");
- anything else (bad magic or version, a length that does not match, an
  unknown type, a request too short to hold its req_id, a malformed record
  of a type only the daemon sends, a malformed ADOPT): an ERROR record
  naming the problem, and the channel is closed, ending its session
  ("on_protocol_error").
Well-formed records that make no sense here (a HELLO from a client, ADOPT
for a session that cannot be resumed) are dropped with their descriptors.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import itertools
import logging
import os
import secrets
import socket
import sys
import time
from typing import TYPE_CHECKING, Any, Coroutine

from ... import errors, fdchannel
from ...config import Settings
from ..core.sessions import Adoption, DeliveryFailed, Session
from ..host.sockets import apply_socket_permissions, prepare_socket_path

if TYPE_CHECKING:
    from ..core.daemon import Daemon

log = logging.getLogger("kvcached.channel")

# Records one channel may have waiting for room in its socket (a client that
# sends requests and reads no replies): past this its session ends at once,
# rather than after fd_send_timeout with a queue that grew all that time.
MAX_WAITING_SENDS = 256
_REQUEST_TYPES = {fdchannel.CloseReq: fdchannel.REQ_CLOSE, fdchannel.AnswerReq: fdchannel.REQ_ANSWER,
                  fdchannel.DroppedReq: fdchannel.REQ_DROPPED, fdchannel.UseReq: fdchannel.REQ_USE}  # the requests _serve_request answers


# ---- running a handler at once ------------------------------------------------
# The channel serves most requests without ever waiting: a one-page ALLOCATE
# from the pool, a FREE of a few pages, their REPLY into a socket with room.
# Wrapping each one in an asyncio Task costs more than the request itself (a
# Task object, a loop iteration, a callback). `eager_start` runs the handler's
# coroutine right away instead, on the read callback's stack; only if it has
# to wait (a page being created on the device worker, a full socket, an
# Allocate waiting for budget) does it become a Task, which carries on from
# exactly where it stopped.
#
# On Python 3.12+ this is asyncio's own eager Task (`Task(..., eager_start=True)`):
# the coroutine's first steps run inside the Task that carries it on, so
# `asyncio.current_task()`, `asyncio.timeout()` and `asyncio.wait_for()` (which
# 3.12 builds on `timeout()`) work before the first wait, also from the read
# callback, which has no Task of its own. On 3.10 and 3.11 it is done here
# with the coroutine protocol itself: the Task drives a small proxy that hands
# the Task the very future the coroutine is waiting on, and hands back
# whatever the Task sends or throws (as `yield from` would), so cancellation
# and exceptions behave as in any Task. There, until its first wait the
# coroutine runs in the caller's task (or none): it must not use
# `asyncio.timeout()` before it (3.11's `wait_for` does not need a task).

EAGER_NATIVE = sys.version_info >= (3, 12)  # asyncio.Task(..., eager_start=True)


class _Resume:
    """An awaitable that continues a coroutine already started."""

    __slots__ = ("_coro", "_first")

    def __init__(self, coro: Coroutine, first: Any):
        self._coro = coro
        self._first = first

    def __await__(self):
        coro, yielded = self._coro, self._first
        self._first = None
        while True:
            try:
                sent = yield yielded
            except BaseException as exc:  # noqa: BLE001 - thrown in by the Task (cancel): pass it on
                try:
                    yielded = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    yielded = coro.send(sent)
                except StopIteration as stop:
                    return stop.value


async def _carry_on(resume: _Resume) -> Any:
    return await resume


def eager_start(coro: Coroutine, tasks: set[asyncio.Task]) -> asyncio.Task | None:
    """Run `coro` now. Returns None when it finished without waiting;
    otherwise the Task that carries it on, added to `tasks` until it is done.
    An exception it raises before waiting is logged, as an unobserved Task's
    would be (callers give it coroutines that handle their own errors)."""
    loop = asyncio.get_running_loop()
    if EAGER_NATIVE:
        task = asyncio.Task(coro, loop=loop, eager_start=True)
        if task.done():
            if not task.cancelled() and task.exception() is not None:
                log.error("request failed", exc_info=task.exception())
            return None
    else:
        try:
            first = coro.send(None)
        except StopIteration:
            return None
        except Exception:  # noqa: BLE001 - mirror an unobserved Task: log, do not raise into the caller
            log.exception("request failed")
            return None
        task = loop.create_task(_carry_on(_Resume(coro, first)))
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    return task


class Conn:
    """The daemon's end of one fd channel: the SessionPort of its session."""

    def __init__(self, server: "ChannelServer", channel_id: int, sock: socket.socket, pid: int, uid: int, gid: int, secret: bytes):
        self._server = server
        self.id = channel_id
        self.sock = sock
        self.pid, self.uid, self.gid = pid, uid, gid
        self.secret = secret
        self.pidfd: int | None = None
        self.session: Session | None = None
        self._closed = False
        self.created = time.monotonic()
        self._send_lock = asyncio.Lock()
        self.adoption = Adoption()
        self.delivering: set[int] = set()  # page ids whose PAGES wait for room (SessionPort.delivering)
        self.closing_req: int | None = None  # a CLOSE being served: its REPLY precedes the GOODBYE
        self.waiting_sends = 0  # records waiting for room in the socket (send's slow path)
        self._writer: asyncio.Future | None = None  # _writable's, while a watcher is on the socket

    @property
    def closed(self) -> bool:
        return self._closed

    # ---- SessionPort ----------------------------------------------------
    async def deliver(self, allocation_id: int, page_ids: list[int], fds: list[int]) -> None:
        total = len(page_ids)
        step = fdchannel.MAX_FDS
        if total <= step and self.send_now(fdchannel.encode_pages(allocation_id, 0, total, page_ids), fds):
            return  # one record, straight into the socket
        timeout = self._server.settings.fd_send_timeout
        self.delivering.update(page_ids)
        try:
            for first in range(0, total, step):
                rec = fdchannel.encode_pages(allocation_id, first, total, page_ids[first : first + step])
                await self.send(rec, fds[first : first + step], timeout)
        finally:
            self.delivering.difference_update(page_ids)

    def hang_up(self, error: errors.KVCachedError | None, pages_returned: int = 0) -> None:
        if self._closed:
            return
        if self.closing_req is not None:
            self.send_nowait(fdchannel.encode_reply(self.closing_req, 0, pages_returned))
        if error is None:
            self.send_nowait(fdchannel.encode_goodbye())
        else:
            self.send_nowait(fdchannel.encode_error(error.code, error.message))
        self.close()

    def leave(self) -> None:
        self.close()

    def ask_drop(self, page_ids: list[int]) -> None:
        step = fdchannel.MAX_DROP_IDS  # a DROP fits the daemon's largest record (max_daemon_record)
        for first in range(0, len(page_ids), step):
            rec = fdchannel.encode_drop(page_ids[first : first + step])
            if not self.send_now(rec):
                self._server.send_later(self, rec)

    # ---- sending --------------------------------------------------------
    def _straight_in(self) -> bool:
        """A record may go straight into the socket, without waiting: the
        channel is open and nobody else waits to send on it (so records
        keep their order)."""
        return not self._closed and not self._send_lock.locked()

    def answer_now(self, allocation_id: int, page_ids: list[int], fds: list[int], req_id: int, held_bytes: int) -> int:
        """An ALLOCATE's PAGES and REPLY in one codec call when that needs no
        waiting (`send_now`'s rule; one PAGES record). Returns the records
        sent (fdchannel.send_answer): 0, the whole answer is `deliver`'s and
        the REPLY's; 1, the PAGES went and the REPLY waits for room."""
        if not self._straight_in():
            return 0
        return fdchannel.send_answer(self.sock, allocation_id, page_ids, fds, req_id, held_bytes)

    def send_now(self, data: bytes, fds: list[int] | tuple = ()) -> bool:
        """Send one record if that needs no waiting: nobody else is waiting
        to send here and the socket has room. False when it must go through
        `send` (which also says why it failed)."""
        if not self._straight_in():
            return False
        try:
            fdchannel.send_record(self.sock, data, fds)
            return True
        except OSError:
            return False

    async def send(self, data: bytes, fds: list[int], timeout: float) -> None:
        """Send one record without blocking the loop; waits for room up to
        `timeout` seconds. Raises DeliveryFailed when it cannot deliver."""
        if self._straight_in():
            try:
                fdchannel.send_record(self.sock, data, fds)
                return
            except BlockingIOError:
                pass
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.ENOBUFS):
                    raise DeliveryFailed(f"send failed: {exc.strerror}") from exc
        if self.waiting_sends >= MAX_WAITING_SENDS:
            raise DeliveryFailed(f"client does not read its fd channel: {self.waiting_sends} records wait for room")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        self.waiting_sends += 1
        try:
            await self._send_when_room(data, fds, timeout, deadline)
        finally:
            self.waiting_sends -= 1

    async def _send_when_room(self, data: bytes, fds: list[int], timeout: float, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        async with self._send_lock:
            while True:
                if self._closed:
                    raise DeliveryFailed("channel closed")
                try:
                    fdchannel.send_record(self.sock, data, fds)
                    return
                except BlockingIOError:
                    pass
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.ENOBUFS):
                        raise DeliveryFailed(f"send failed: {exc.strerror}") from exc
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise DeliveryFailed(f"client did not read its fd channel for {timeout:g} s")
                await self._writable(min(remaining, 0.05))

    async def _writable(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        fut = self._writer = loop.create_future()
        fd = self.sock.fileno()
        loop.add_writer(fd, lambda: fut.done() or fut.set_result(None))
        try:
            await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            if self._writer is fut:  # else close() removed it (the fd number may be another socket's by now)
                self._writer = None
                loop.remove_writer(fd)

    def send_nowait(self, data: bytes) -> None:
        """Best effort (REPLY to CLOSE, GOODBYE, ERROR before closing)."""
        try:
            fdchannel.send_record(self.sock, data)
        except OSError:
            pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.adoption.discard()
        loop = asyncio.get_event_loop()
        if self._writer is not None:  # a send waits for room: no watcher may outlive the fd (uvloop aborts)
            loop.remove_writer(self.sock.fileno())
            self._writer.done() or self._writer.set_result(None)
            self._writer = None
        for fd in (self.sock.fileno(), self.pidfd):
            if fd is not None and fd >= 0:
                try:
                    loop.remove_reader(fd)
                except (ValueError, OSError):
                    pass
        try:
            self.sock.close()
        except OSError:
            pass
        if self.pidfd is not None:
            try:
                os.close(self.pidfd)
            except OSError:
                pass
            self.pidfd = None
        self._server._forget(self)


class ChannelServer:
    """The fd channel listener and every channel on it (the core's PortDirectory)."""

    def __init__(self, daemon: "Daemon", settings: Settings):
        self.daemon = daemon
        self.settings = settings
        self.channels: dict[int, Conn] = {}
        self._unbound: dict[bytes, Conn] = {}
        self.paused = False  # a stop the sessions outlive has begun (pause)
        self._ids = itertools.count(1)
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task] = set()  # requests being served
        self._sweeper: asyncio.Task | None = None
        daemon.attach(self)

    # ---- life cycle -----------------------------------------------------
    def start(self) -> None:
        path = self.settings.fd_socket
        prepare_socket_path(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        sock.bind(path)
        apply_socket_permissions(path, self.settings)
        sock.listen(128)
        self._listener = sock
        loop = asyncio.get_running_loop()
        loop.add_reader(sock.fileno(), self._accept)
        self._sweeper = loop.create_task(self._sweep())

    def stop_accepting(self) -> None:
        if self._listener is not None:
            asyncio.get_running_loop().remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None

    def pause(self) -> None:
        """PortDirectory.pause: no new channel, no more requests read."""
        self.paused = True
        self.stop_accepting()
        loop = asyncio.get_event_loop()
        for conn in list(self.channels.values()):
            if not conn.closed:
                try:
                    loop.remove_reader(conn.sock.fileno())
                except (ValueError, OSError):
                    pass

    def shutdown(self, error: errors.KVCachedError | None) -> None:
        """PortDirectory.shutdown: close every channel (ERROR first; None:
        without a word, for a stop its sessions outlive), stop listening,
        remove the socket file."""
        self.stop_accepting()
        for conn in list(self.channels.values()):
            if error is None:
                conn.close()
            else:
                self._drop(conn, error)
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        try:
            os.unlink(self.settings.fd_socket)
        except FileNotFoundError:
            pass

    async def _sweep(self) -> None:
        """Channels left without a session for channel_bind_timeout are closed."""
        while True:
            await asyncio.sleep(0.5)
            limit = self.settings.channel_bind_timeout
            now = time.monotonic()
            for conn in [c for c in self._unbound.values() if now - c.created > limit]:
                self._drop(conn, errors.FailedPrecondition(f"no OpenSession within {limit:g} s"))

    # ---- PortDirectory --------------------------------------------------
    def find(self, secret: bytes) -> Conn:
        if len(secret) != fdchannel.SECRET_SIZE:
            raise errors.InvalidArgument(f"channel_secret must be {fdchannel.SECRET_SIZE} bytes from the fd channel's HELLO, got {len(secret)}")
        for candidate_secret, candidate in self._unbound.items():
            if hmac.compare_digest(candidate_secret, secret) and not candidate.closed:
                return candidate
        raise errors.FailedPrecondition("unknown or already used channel secret: connect the fd channel and use the secret from its HELLO")

    def bind(self, port: Conn, session: Session) -> None:
        self._unbound.pop(port.secret, None)
        port.session = session

    def adoption(self, port: Conn) -> Adoption:
        """The ADOPT records of this channel. The client sent them before
        calling ResumeSession, so they are in the socket by now: read every
        record waiting there first (no waiting, no polling)."""
        while not port.closed and self._read_one(port):
            pass
        if port.closed:
            raise errors.FailedPrecondition("the fd channel closed before ResumeSession")
        return port.adoption

    # ---- accepting ------------------------------------------------------
    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self.daemon.count("fd_channel_errors")
                log.warning("fd channel accept failed: %s", exc)
                return
            try:
                self._admit(sock)
            except Exception:
                self.daemon.count("fd_channel_errors")
                log.exception("fd channel set-up failed")
                sock.close()

    def _admit(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        pid, uid, gid = fdchannel.peer_credentials(sock)
        conn = Conn(self, next(self._ids), sock, pid, uid, gid, secrets.token_bytes(fdchannel.SECRET_SIZE))
        refusal = self._refusal(conn)
        if refusal is None and self.daemon.shutting_down:
            refusal = errors.Unavailable("the daemon is shutting down")
        if refusal is not None:
            log.warning("refused fd channel from pid %d uid %d: %s", pid, uid, refusal.message)
            conn.send_nowait(fdchannel.encode_error(refusal.code, refusal.message))
            sock.close()
            return
        loop = asyncio.get_running_loop()
        self.channels[conn.id] = conn
        self._unbound[conn.secret] = conn
        if pid > 0:
            try:
                conn.pidfd = os.pidfd_open(pid)
                loop.add_reader(conn.pidfd, self._peer_exited, conn)
            except ProcessLookupError:
                self._lost(conn, crashed=True)
                return
            except OSError as exc:
                log.debug("pidfd_open(%d) failed: %s; relying on the socket alone", pid, exc)
        loop.add_reader(sock.fileno(), self._read_one, conn)
        conn.send_nowait(fdchannel.encode_hello(fdchannel.Hello(conn.id, pid, uid, gid, fdchannel.MAX_FDS, conn.secret)))
        log.debug("fd channel %d: pid %d uid %d gid %d", conn.id, pid, uid, gid)

    def _refusal(self, conn: Conn) -> errors.KVCachedError | None:
        allowed = self.settings.allowed_uids
        if allowed and conn.uid not in allowed and conn.uid != os.getuid():
            return errors.PermissionDenied(f"uid {conn.uid} is not allowed to use this daemon (allowed_uids)")
        per_uid = sum(1 for c in self.channels.values() if c.uid == conn.uid)
        if per_uid >= self.settings.max_sessions_per_uid:
            return errors.ResourceExhausted(
                f"uid {conn.uid} already has {per_uid} fd channels open (max_sessions_per_uid={self.settings.max_sessions_per_uid})"
            )
        if len(self.channels) >= self.settings.max_sessions:
            return errors.ResourceExhausted(f"the daemon already has {len(self.channels)} channels open (max_sessions)")
        return None

    # ---- records in ------------------------------------------------------
    def _read_one(self, conn: Conn) -> bool:
        """Read and handle one record; False when nothing was waiting (or
        the channel is gone)."""
        try:
            rec = fdchannel.recv_request(conn.sock, fdchannel.MAX_CLIENT_RECORD)
        except (BlockingIOError, InterruptedError):
            return False
        except fdchannel.MalformedRequest as exc:
            # framing sound, req_id readable: answer it; the session goes on
            self.daemon.count("fd_channel_malformed_requests")
            log.info("fd channel %d (pid %d): %s; answered INVALID_ARGUMENT", conn.id, conn.pid, exc)
            conn.send_nowait(fdchannel.encode_reply(exc.req_id, errors.Code.INVALID_ARGUMENT, 0, exc.message))
            return True
        except fdchannel.ProtocolError as exc:
            self.daemon.count("fd_channel_errors")
            log.info("fd channel %d (pid %d): protocol error: %s; closing it", conn.id, conn.pid, exc)
            self._drop(conn, errors.InvalidArgument(f"fd channel protocol error: {exc}"))
            return False
        except OSError:
            rec = None
        if type(rec) is tuple:  # a one-page FREE or a plain ALLOCATE (fdchannel.decode_hot)
            s = conn.session
            if s is None:
                self._refuse_before_session(conn, rec[1])
            elif rec[0] == fdchannel.REQ_ALLOCATE:
                _, req, n, flags, wait_ms = rec
                eager_start(self._serve_allocate(conn, s, req, n, bool(flags & fdchannel.ALLOC_WAIT), wait_ms,
                                                 bool(flags & fdchannel.ALLOC_NOTIFY), ""), self._tasks)
            else:
                eager_start(self._serve_free(conn, s, rec[1], [rec[2]], rec[3]), self._tasks)
            return True
        if rec is None:
            self._lost(conn, crashed=conn.session is not None)
            return False
        if isinstance(rec, (fdchannel.AllocateReq, fdchannel.FreeReq, fdchannel.CloseReq, fdchannel.AnswerReq, fdchannel.DroppedReq,
                            fdchannel.UseReq)):
            if conn.session is None:
                self._refuse_before_session(conn, rec.req_id)
            elif isinstance(rec, fdchannel.AllocateReq):
                # Served at once; a Task only if it has to wait (eager_start).
                eager_start(self._serve_allocate(conn, conn.session, rec.req_id, rec.num_pages, rec.wait, rec.wait_timeout_ms,
                                                 rec.notify, rec.device), self._tasks)
            elif isinstance(rec, fdchannel.FreeReq):
                eager_start(self._serve_free(conn, conn.session, rec.req_id, list(rec.page_ids), rec.flags), self._tasks)
            else:
                eager_start(self._serve_request(conn, conn.session, rec), self._tasks)
            return True
        if isinstance(rec, fdchannel.Adopt) and conn.session is None:
            self._collect_adopt(conn, rec)
            return True
        fdchannel.close_fds(getattr(rec, "fds", ()))  # well-formed, but not for the daemon: dropped
        return True

    def _collect_adopt(self, conn: Conn, rec: fdchannel.Adopt) -> None:
        """Keep the fds of pages the journal gave that orphan (of this uid),
        for ResumeSession; close the rest. All ADOPT records of one channel
        must name one session."""
        a = conn.adoption
        if a.fds and a.session_id != rec.session_id:
            fdchannel.close_fds(rec.fds)
            return
        for pid, fd in zip(rec.page_ids, rec.fds):
            if not self.daemon.may_adopt(rec.session_id, conn.uid, pid):
                fdchannel.close_fds([fd])
                continue
            a.session_id = rec.session_id
            old = a.fds.pop(pid, None)
            if old is not None:
                fdchannel.close_fds([old])
            a.fds[pid] = fd

    @staticmethod
    def _refuse_before_session(conn: Conn, req_id: int) -> None:
        """A request on a channel no session is bound to yet."""
        conn.send_nowait(fdchannel.encode_reply(req_id, errors.Code.FAILED_PRECONDITION, 0,
                                                "no session on this fd channel yet: call OpenSession first"))

    # A request record from a session's own fd channel: the kernel vouches
    # for the sender, so no token is needed. Each is answered with REPLY
    # (for ALLOCATE after its PAGES records; for CLOSE just before the
    # GOODBYE, by Conn.hang_up). ALLOCATE and FREE, the requests of every
    # grow and trim, have their own coroutines taking plain values (the
    # common ones arrive as fdchannel.decode_hot tuples, no record object).
    async def _serve_allocate(self, conn: Conn, s: Session, req_id: int, n: int, wait: bool, wait_ms: int, notify: bool,
                              device: str) -> None:
        """The loan (booked and journaled by the core), then its PAGES
        records, then the REPLY. A loan not delivered goes back
        (Daemon.undelivered: a failed delivery ends the session)."""
        d = self.daemon
        try:
            a = await d.lend(s, device, n, wait, wait_ms, notify, req_id | fdchannel.CHANNEL_ALLOC_BIT)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a REPLY code
            await self._reply_failure(conn, req_id, exc, "ALLOCATE")
            return
        sent = conn.answer_now(a.allocation_id, a.page_ids, a.fds, req_id, a.held_bytes)
        if sent == 2:  # PAGES and REPLY straight into the socket: the common path
            if a.owned:  # exports made for this delivery: the client has its own now, ours go
                a.close()
            return
        try:
            if not sent:
                await conn.deliver(a.allocation_id, a.page_ids, a.fds)
        except BaseException as exc:
            a.close()
            try:
                d.undelivered(s, a, exc)
                raise
            except Exception as err:  # noqa: BLE001 - a cancellation goes on up
                await self._reply_failure(conn, req_id, err, "ALLOCATE")
                return
        if a.owned:  # exports made for this delivery: the client has its own now, ours go
            a.close()
        await self._reply(conn, fdchannel.encode_reply(req_id, 0, a.held_bytes))

    async def _serve_free(self, conn: Conn, s: Session, req_id: int, page_ids: list[int], flags: int = 0) -> None:
        """FREE: the pages go back (with keep: this session keeps their
        handles), or with standby stay the session's as standby."""
        try:
            if flags & fdchannel.FREE_STANDBY:
                freed = self.daemon.standby(s, page_ids)
            else:
                freed, _ = await self.daemon.free(s, page_ids, bool(flags & fdchannel.FREE_KEEP))
        except Exception as exc:  # noqa: BLE001
            await self._reply_failure(conn, req_id, exc, "FREE")
            return
        await self._reply(conn, fdchannel.encode_reply(req_id, 0, freed))

    async def _serve_request(self, conn: Conn, s: Session, rec) -> None:
        """CLOSE, ANSWER, DROPPED and USE."""
        d = self.daemon
        try:
            if isinstance(rec, fdchannel.AnswerReq):
                value = d.answer_reclaim(s, rec.reclaim_id, rec.bytes_given, rec.bytes_kept, rec.reason)
            elif isinstance(rec, fdchannel.DroppedReq):
                value = d.dropped(s, list(rec.page_ids))
            elif isinstance(rec, fdchannel.UseReq):
                value = d.use(s, list(rec.page_ids))
            else:
                conn.closing_req = rec.req_id
                await d.close_session(s)
                return
        except Exception as exc:  # noqa: BLE001
            conn.closing_req = None
            await self._reply_failure(conn, rec.req_id, exc, fdchannel.NAMES[_REQUEST_TYPES[type(rec)]])
            return
        await self._reply(conn, fdchannel.encode_reply(rec.req_id, 0, value))

    async def _reply_failure(self, conn: Conn, req_id: int, exc: Exception, what: str) -> None:
        if self.paused:  # a stop the sessions outlive: no error it caused reaches the client (pause)
            return
        code, message = errors.status_of(exc)
        if code == errors.Code.INTERNAL:
            log.error("fd channel request %s failed", what, exc_info=exc)
        await self._reply(conn, fdchannel.encode_reply(req_id, code, 0, message))

    async def _reply(self, conn: Conn, data: bytes) -> None:
        """Send a REPLY: straight into the socket when it has room (no
        coroutine, no lock), else through Conn.send's wait for room. A
        client that leaves its channel full for fd_send_timeout, or lets
        MAX_WAITING_SENDS records pile up, loses its session (docs/protocol.md,
        "Slow readers"): its pages go back, and the daemon holds no growing
        queue of replies for it."""
        if conn.send_now(data):
            return
        try:
            await conn.send(data, [], self.settings.fd_send_timeout)
        except DeliveryFailed as exc:
            if conn.closed:
                return  # nobody to answer
            self.daemon.count("fd_channel_errors")
            log.warning("fd channel %d (pid %d uid %d): %s; ending its session", conn.id, conn.pid, conn.uid, exc)
            self._drop(conn, errors.Unavailable(f"session ended: {exc}"))

    def send_later(self, conn: Conn, data: bytes) -> None:
        """A record the daemon sends on its own (DROP) that found no room:
        sent when there is, within fd_send_timeout, or the session ends."""
        task = asyncio.get_running_loop().create_task(self._reply(conn, data))  # a REPLY's path: room, or the session ends
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- hang-up ----------------------------------------------------------
    def _peer_exited(self, conn: Conn) -> None:
        self._lost(conn, crashed=True)

    def _lost(self, conn: Conn, crashed: bool) -> None:
        """The peer is gone (EOF, exit): close, then end its session."""
        if conn.closed:
            return
        conn.close()
        if conn.session is not None:
            self.daemon.session_lost(conn.session, crashed)

    def _drop(self, conn: Conn, error: errors.KVCachedError) -> None:
        """Close the channel with an ERROR record; its session ends."""
        if conn.closed:
            return
        if conn.session is not None and not conn.session.closed:
            self.daemon.end_session(conn.session, error.message, farewell=error)  # hangs up with the ERROR
        else:
            conn.send_nowait(fdchannel.encode_error(error.code, error.message))
            conn.close()

    def _forget(self, conn: Conn) -> None:
        self._unbound.pop(conn.secret, None)
        self.channels.pop(conn.id, None)
