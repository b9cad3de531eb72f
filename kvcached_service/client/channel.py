"""The client's end of the fd channel (docs/protocol.md, "Client semantics").

Who reads the socket: a request's own thread, while it waits for its
REPLY (one reader at a time, the others wait on a condition and take over
when it is done), so the answer to a request costs no thread switch in this
process. While no request is in flight, a watcher thread reads: it sleeps in
poll() for a hang-up only (data arriving does not wake it) and looks for
records every IDLE_CHECK seconds, so a daemon going away is noticed at once
and records nobody asked for (an ERROR, pages of an abandoned request) within
IDLE_CHECK. Whoever reads handles every record (an allocation can be larger
than a socket buffer, and the daemon writes its PAGES records before the
REPLY):

- PAGES are kept by allocation id until the request that asked for them is
  answered. A record that does not fit its allocation (past its total, a
  total that changes, an index twice) is a protocol error. An allocation
  nobody waits for any more (its request gave up: deadline) is given back
  as soon as it is complete: descriptors closed, FREE sent.
- REPLY goes to the request waiting for it; a REPLY nobody waits for is
  dropped.
- ERROR or GOODBYE: the daemon ended the session; every waiting and later
  request fails with that error (GOODBYE: FAILED_PRECONDITION).
- End of stream or a socket error: a hang-up (the daemon went away).
  `on_hangup` runs once (the session may resume); waiting requests fail
  with UNAVAILABLE.
- A malformed record, or one the daemon never sends (HELLO again, ADOPT,
  ALLOCATE, FREE, CLOSE): a protocol error. The client closes the channel
  (the daemon then ends the session) and requests fail with INTERNAL
  "fd channel protocol error: ...". No resume.

Requests (ALLOCATE, FREE, CLOSE) may be in flight from many threads at once.
"""

from __future__ import annotations

import errno
import itertools
import logging
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .. import errors, fdchannel

log = logging.getLogger("kvcached.client")

IDLE_CHECK = 0.05  # seconds between the watcher's looks for records while no request waits
_POLLRDHUP = getattr(select, "POLLRDHUP", 0x2000)
_PEER_GONE = (errno.EPIPE, errno.ECONNRESET)  # a send that failed because the daemon's end closed
_HANGUP_NOTICE = 2.0  # seconds a request whose send failed so waits for the reader to see the hang-up


class ProtocolViolation(errors.Internal):
    """The daemon broke the wire protocol on the fd channel."""

    def __init__(self, detail: str):
        super().__init__(f"fd channel protocol error: {detail}")


@dataclass
class _Pending:
    """An allocation's PAGES records so far."""

    total: int = 0
    ids: dict[int, int] = field(default_factory=dict)  # index -> page id
    fds: dict[int, int] = field(default_factory=dict)  # index -> fd
    wanted: bool = True  # a request waits for it; False once it gave up

    @property
    def complete(self) -> bool:
        return self.total > 0 and len(self.fds) == self.total


@dataclass
class _Waiter:
    kind: str
    reply: fdchannel.Reply | None = None
    done: bool = False
    pages: _Pending | None = None  # an ALLOCATE's pages, taken with its REPLY


class Channel:
    """A connected fd channel, after HELLO."""

    def __init__(self, path: str, timeout: float, on_hangup: Callable[["Channel"], None] | None = None,
                 on_drop: Callable[[list[int]], None] | None = None):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self.sock.settimeout(timeout)
        self.timeout = timeout
        try:
            self.sock.connect(path)
            rec = fdchannel.recv_record(self.sock)
        except fdchannel.ProtocolError as exc:
            self.sock.close()
            raise ProtocolViolation(f"{path}: first record: {exc}") from None
        except OSError as exc:
            self.sock.close()
            raise errors.Unavailable(f"cannot connect the fd channel {path}: {exc}") from None
        if isinstance(rec, fdchannel.Error):
            self.sock.close()
            raise errors.from_code(rec.code, rec.message)
        if not isinstance(rec, fdchannel.Hello):
            self.sock.close()
            if rec is None:
                raise errors.Unavailable(f"fd channel {path}: closed before HELLO")
            raise ProtocolViolation(f"{path}: expected HELLO, got {type(rec).__name__}")
        self.hello = rec
        self.sock.settimeout(None)
        self._cond = threading.Condition()
        self._pending: dict[int, _Pending] = {}  # allocation id -> its pages so far
        self._waiters: dict[int, _Waiter] = {}  # request id -> waiter
        self._ended: errors.KVCachedError | None = None
        self.hung_up = False
        self._closing = False
        self._req_ids = itertools.count(1)
        self._reading = False  # someone holds the reading role (under _cond)
        self._poller: select.poll | None = None  # the reading role's poll object
        self.on_hangup = on_hangup
        self.on_drop = on_drop  # releases kept handles of the pages a DROP names (before DROPPED goes out)
        self._reader = threading.Thread(target=self._watch, name="kvcached-fdchannel", daemon=True)
        self._reader.start()

    @property
    def ended(self) -> errors.KVCachedError | None:
        """Why the channel ended (None while it is up)."""
        return self._ended

    # ---- reading ------------------------------------------------------------
    def _read_record(self) -> bool:
        """Read and handle one record; the caller holds the reading role and
        knows one is there (poll said so). False once the channel ended."""
        hangup = False
        try:
            rec = fdchannel.recv_record(self.sock)
        except fdchannel.ProtocolError as exc:  # its descriptors are closed
            ended: errors.KVCachedError = ProtocolViolation(str(exc))
        except OSError as exc:
            ended, hangup = errors.Unavailable(f"the daemon went away (fd channel: {exc.strerror or exc})"), True
        else:
            if rec is None:
                ended, hangup = errors.Unavailable("the daemon went away (its fd channel closed)"), True
            else:
                try:
                    if isinstance(rec, fdchannel.Pages):
                        self._pages(rec)
                        return True
                    if isinstance(rec, fdchannel.Reply):
                        self._reply(rec)
                        return True
                    if isinstance(rec, fdchannel.Drop):
                        self._drop(rec)
                        return True
                except ProtocolViolation as exc:
                    ended = exc
                else:
                    if isinstance(rec, fdchannel.Error):
                        ended = errors.from_code(rec.code, rec.message)
                    elif isinstance(rec, fdchannel.Goodbye):
                        ended = errors.FailedPrecondition("the daemon ended this session (GOODBYE)")
                    else:  # HELLO again, or a record only clients send
                        fdchannel.close_fds(getattr(rec, "fds", ()))
                        ended = ProtocolViolation(f"the daemon sent a {type(rec).__name__} record")
        self._end(ended, hangup)
        return False

    def _readable(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for a record (or the end of the
        stream). Only the holder of the reading role calls it, so one poll
        object serves every reader in turn."""
        p = self._poller
        if p is None:
            p = self._poller = select.poll()
            try:
                p.register(self.sock.fileno(), select.POLLIN)
            except (OSError, ValueError):  # closed under us
                return True
        try:
            return bool(p.poll(max(0, int(timeout * 1000 + 0.999))))
        except (OSError, ValueError, RuntimeError):  # closed under us
            return True  # recv reports what happened

    def _watch(self) -> None:
        """The watcher thread: reads only while no request waits (see the
        module's docstring)."""
        hup = select.poll()
        try:
            hup.register(self.sock.fileno(), _POLLRDHUP)  # POLLHUP and POLLERR come anyway
        except (OSError, ValueError):
            return
        while True:
            try:
                hung = bool(hup.poll(int(IDLE_CHECK * 1000)))
            except OSError:
                hung = True
            with self._cond:
                if self._ended is not None:
                    return
                if self._reading or self._waiters:
                    if hung:  # a request's reader will meet the end of the stream
                        self._cond.wait(IDLE_CHECK)
                    continue
                self._reading = True
            try:
                alive = True
                while alive and self._readable(0):
                    alive = self._read_record()
            finally:
                with self._cond:
                    self._reading = False
                    self._cond.notify_all()
            if not alive:
                return

    def _await(self, w: _Waiter, timeout: float) -> None:
        """Wait until `w` is answered or the channel ends, reading the socket
        whenever nobody else is; returns at the deadline otherwise. Called
        and returns with _cond held."""
        deadline = time.monotonic() + timeout
        cond = self._cond
        while not w.done and self._ended is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            if self._reading:
                cond.wait(remaining)
                continue
            self._reading = True
            cond.release()
            try:
                if self._readable(remaining):
                    self._read_record()
            finally:
                cond.acquire()
                self._reading = False
                cond.notify_all()  # another request's thread may read now, or its answer came

    def _end(self, ended: errors.KVCachedError, hangup: bool) -> None:
        with self._cond:
            if self._ended is None:
                self._ended = ended
                self.hung_up = hangup
            else:  # already ended (a protocol error a request found): not a hang-up now
                hangup = False
            for p in self._pending.values():
                fdchannel.close_fds(p.fds.values())
            self._pending.clear()
            closing = self._closing
            self._cond.notify_all()
        if isinstance(ended, ProtocolViolation):
            log.error("%s; closing the fd channel", ended.message)
            try:
                self.sock.shutdown(socket.SHUT_RDWR)  # the daemon ends the session
            except OSError:
                pass
        if hangup and not closing and self.on_hangup is not None:
            self.on_hangup(self)

    def _pages(self, rec: fdchannel.Pages) -> None:
        """Keep a PAGES record with its allocation (under the lock)."""
        with self._cond:
            p = self._pending.get(rec.allocation_id)
            if p is None:
                # Not (yet) asked for by a request: give it back once complete.
                p = self._pending[rec.allocation_id] = _Pending(wanted=False)
            if p.total == 0:
                p.total = rec.total
            if rec.total != p.total:
                fdchannel.close_fds(rec.fds)
                raise ProtocolViolation(f"allocation {rec.allocation_id}: a record says {rec.total} pages, an earlier one {p.total}")
            for i, (pid, fd) in enumerate(zip(rec.page_ids, rec.fds)):
                j = rec.first_index + i
                if j in p.fds:
                    fdchannel.close_fds(rec.fds[i:])
                    raise ProtocolViolation(f"allocation {rec.allocation_id}: page index {j} sent twice")
                p.ids[j], p.fds[j] = pid, fd
            if p.complete and not p.wanted:
                self._give_back_locked(rec.allocation_id)

    def _reply(self, rec: fdchannel.Reply) -> None:
        with self._cond:
            w = self._waiters.get(rec.req_id)
            if w is None:
                log.debug("fd channel: REPLY to no waiting request (%d, code %d)", rec.req_id, rec.code)
                return
            w.reply, w.done = rec, True
            if w.kind == "Allocate":  # its pages are the caller's now, whatever comes next
                w.pages = self._pending.pop(rec.req_id | fdchannel.CHANNEL_ALLOC_BIT, None)
            self._cond.notify_all()

    def _drop(self, rec: fdchannel.Drop) -> None:
        """DROP: let the kept handles of these pages go, then say so with
        DROPPED, at once and without waiting for its REPLY (which waits for
        no request, and is dropped): docs/protocol.md, "Kept handles"."""
        ids = list(rec.page_ids)
        if self.on_drop is not None:
            self.on_drop(ids)
        try:
            fdchannel.send_record(self.sock, fdchannel.encode_dropped(next(self._req_ids), ids))
        except OSError:
            pass  # the channel is going: the session ends, and its keeps with it

    def _give_back_locked(self, alloc_id: int) -> None:
        """An allocation nobody will claim: close its fds, FREE its pages
        (the answer is not waited for)."""
        p = self._pending.pop(alloc_id)
        fdchannel.close_fds(p.fds.values())
        ids = [p.ids[i] for i in sorted(p.ids)]
        log.warning("fd channel: giving back %d pages of allocation %d that nobody waits for", len(ids), alloc_id)
        for i in range(0, len(ids), fdchannel.MAX_FREE_IDS):
            try:
                fdchannel.send_record(self.sock, fdchannel.encode_free(next(self._req_ids), ids[i : i + fdchannel.MAX_FREE_IDS]))
            except OSError:
                return  # the channel is going: the session ends, and its pages with it

    # ---- requests ------------------------------------------------------------
    def _call(self, kind: str, timeout: float, encode: Callable[..., bytes], *args: Any, alloc: bool = False,
              **kwargs: Any) -> tuple[int, _Waiter]:
        """Send a request (`encode(req_id, *args, **kwargs)`) and wait for
        its REPLY. On a timeout the request is abandoned (an ALLOCATE's
        pages are given back when they come)."""
        with self._cond:
            if self._ended is not None:
                raise self._ended
            req = next(self._req_ids)
            self._waiters[req] = _Waiter(kind)
            if alloc:
                self._pending.setdefault(req | fdchannel.CHANNEL_ALLOC_BIT, _Pending())
        try:
            fdchannel.send_request(self.sock, encode, req, *args, **kwargs)
        except OSError as exc:
            with self._cond:
                self._waiters.pop(req, None)
                self._pending.pop(req | fdchannel.CHANNEL_ALLOC_BIT, None)
                if exc.errno in _PEER_GONE and not self._closing:
                    # The daemon went away and the reader has not met the end
                    # of the stream yet: wait for it, so the caller sees a
                    # hang-up (a resumable session defers a Free then; before,
                    # a Free that lost this race raised a plain UNAVAILABLE
                    # and its unmapped pages were claimed at the resume).
                    self._cond.wait_for(lambda: self._ended is not None, _HANGUP_NOTICE)
                ended = self._ended
            raise ended if ended is not None else errors.Unavailable(f"the daemon went away (fd channel: {exc.strerror or exc})") from None
        with self._cond:
            w = self._waiters[req]
            self._await(w, timeout)
            del self._waiters[req]
            if w.done:
                return req, w
            if self._ended is not None:
                raise self._ended
            if alloc:  # abandoned: its pages go back once they are all here
                p = self._pending.get(req | fdchannel.CHANNEL_ALLOC_BIT)
                if p is not None:
                    p.wanted = False
                    if p.complete:
                        self._give_back_locked(req | fdchannel.CHANNEL_ALLOC_BIT)
        raise errors.DeadlineExceeded(f"{kind}: no answer on the fd channel within {timeout:g} s")

    def allocate(self, num_pages: int, device: str, wait: bool, notify: bool, wait_ms: int, timeout: float) -> tuple[int, int, list[int], list[int]]:
        """ALLOCATE. Returns (allocation id, held bytes, page ids, fds): the
        PAGES records came before the REPLY, so they are all here."""
        req, w = self._call("Allocate", timeout, fdchannel.encode_allocate, num_pages, device, wait, notify, wait_ms, alloc=True)
        alloc_id = req | fdchannel.CHANNEL_ALLOC_BIT
        rep, p = w.reply, w.pages
        assert rep is not None
        if rep.code:
            if p is not None and p.fds:
                fdchannel.close_fds(p.fds.values())
                self._violation(f"request {req}: PAGES came before an error REPLY")
            raise errors.from_code(rep.code, rep.message)
        if p is None or not p.complete or p.total != num_pages:
            got = 0 if p is None else len(p.fds)
            if p is not None:
                fdchannel.close_fds(p.fds.values())
            self._violation(f"request {req}: {got} of {num_pages} pages arrived before the answer")
        assert p is not None
        return alloc_id, rep.value, [p.ids[i] for i in range(p.total)], [p.fds[i] for i in range(p.total)]

    def free(self, page_ids: list[int], timeout: float, keep: bool = False, standby: bool = False) -> int:
        """FREE (all or nothing per record of at most MAX_FREE_IDS ids).
        Returns pages freed. `keep`: this process keeps the pages' imported
        handles (the FREE record's keep flag); `standby`: the pages stay the
        session's, kept mapped as standby (the standby flag)."""
        n = 0
        for i in range(0, len(page_ids), fdchannel.MAX_FREE_IDS):
            chunk = page_ids[i : i + fdchannel.MAX_FREE_IDS]
            rep = self._call("Free", timeout, fdchannel.encode_free, chunk, keep, standby=standby)[1].reply
            assert rep is not None
            if rep.code:
                raise errors.from_code(rep.code, rep.message)
            n += rep.value
        return n

    def send_use(self, page_ids: list[int]) -> None:
        """USE: standby pages in use again. Not waited for (its REPLY waits
        for no request and is dropped): the pages were the session's all
        along, the record only corrects the daemon's books."""
        for i in range(0, len(page_ids), fdchannel.MAX_FREE_IDS):
            try:
                fdchannel.send_record(self.sock, fdchannel.encode_use(next(self._req_ids), page_ids[i : i + fdchannel.MAX_FREE_IDS]))
            except OSError:
                return  # the channel is going; a resumed session's pages are all in use again

    def close_session(self, timeout: float) -> int:
        """CLOSE: the session ends; returns the pages it gave back."""
        with self._cond:
            self._closing = True
        rep = self._call("CloseSession", timeout, fdchannel.encode_close)[1].reply
        assert rep is not None
        if rep.code:
            raise errors.from_code(rep.code, rep.message)
        return rep.value

    def answer(self, reclaim_id: int, bytes_given: int, bytes_kept: int, reason: str, timeout: float) -> int:
        """ANSWER a reclaim request; returns the bytes the daemon's books
        show the session holding on that device."""
        why = reason.encode("utf-8", "replace")[: fdchannel.MAX_REASON].decode("utf-8", "ignore")
        rep = self._call("AnswerReclaim", timeout, fdchannel.encode_answer, reclaim_id, bytes_given, bytes_kept, why)[1].reply
        assert rep is not None
        if rep.code:
            raise errors.from_code(rep.code, rep.message)
        return rep.value

    def send_adopt(self, session_id: int, ids: list[int], fds: list[int]) -> None:
        """ADOPT records for a resume (before ResumeSession)."""
        for i in range(0, len(ids), fdchannel.MAX_FDS):
            chunk = ids[i : i + fdchannel.MAX_FDS]
            fdchannel.send_record(self.sock, fdchannel.encode_adopt(session_id, i, len(ids), chunk), fds[i : i + fdchannel.MAX_FDS])

    def _violation(self, detail: str) -> None:
        """A protocol error found by a request: end the channel, raise."""
        err = ProtocolViolation(detail)
        with self._cond:
            if self._ended is None:
                self._ended = err
            self._cond.notify_all()
        log.error("%s; closing the fd channel", err.message)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        raise err

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
            for p in self._pending.values():
                fdchannel.close_fds(p.fds.values())
            self._pending.clear()
        self.sock.close()
