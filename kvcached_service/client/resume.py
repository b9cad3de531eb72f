"""Resume after a daemon restart, client side (docs/protocol.md, "Client
semantics"; docs/reliability.md).

A daemon started with --state-dir answers OpenSession with a resume token.
Such a session keeps a duplicate descriptor of every page it holds (`Keeper`);
when its fd channel hangs up (end of stream: the daemon died; not after an
ERROR or GOODBYE, which end the session for good) a thread reconnects with
backoff, re-sends every kept page as ADOPT records on a new channel and
calls ResumeSession with their ids. Mapped pages never move.

Keep: a page is kept from the moment its allocation is answered until a
Free of it succeeds. The daemon may lend a freed id again, possibly to
another thread of the session before the first thread's Free returned: each
kept entry has a sequence number, and a Free forgets only the entry it saw.

Defer: a Free while the daemon is away (the session is resuming, or the
channel hangs up before the Free's answer) succeeds at once: the pages are
deferred, never claimed at the next resume, so the restarted daemon forgets
them, which frees them. A page deferred after its ADOPT record went out is
freed on the new channel once the resume completed ("late" pages).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Callable

from .. import errors, fdchannel
from .channel import Channel

if TYPE_CHECKING:
    from .rpc import Rpc
    from .types import Opened

log = logging.getLogger("kvcached.client")

FIRST_DELAY = 0.05
MAX_DELAY = 1.0


class Keeper:
    """The page descriptors a resumable session keeps, and its deferred frees."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._keep: dict[int, tuple[int, int]] = {}  # page id -> (sequence, dup fd)
        self._seq = 0
        self._deferred: dict[int, int] = {}  # page id -> sequence of the kept entry
        self._claimed: set[int] = set()  # ids in the ADOPT records of the resume in flight

    def keep(self, ids, fds) -> None:
        with self.lock:
            for pid, fd in zip(ids, fds):
                self._seq += 1
                old = self._keep.get(pid)
                if old is not None:  # re-lent before an earlier Free of it returned
                    fdchannel.close_fds([old[1]])
                self._keep[pid] = (self._seq, os.dup(fd))
                self._deferred.pop(pid, None)

    def seqs(self, ids) -> dict[int, int]:
        """The kept entries of pages about to be freed."""
        with self.lock:
            return {i: self._keep[i][0] for i in ids if i in self._keep}

    def not_held(self, ids) -> list[int]:
        """The ids in `ids` this session does not hold (empty: all held)."""
        with self.lock:
            return [i for i in ids if i not in self._keep or i in self._deferred]

    def forget(self, seqs: dict[int, int]) -> None:
        """A Free succeeded: drop the entries it saw."""
        with self.lock:
            self._forget_locked(seqs)

    def _forget_locked(self, seqs: dict[int, int]) -> None:
        for i, seq in seqs.items():
            kept = self._keep.get(i)
            if kept is not None and kept[0] == seq:
                fdchannel.close_fds([self._keep.pop(i)[1]])
            self._deferred.pop(i, None)

    def defer(self, seqs: dict[int, int]) -> None:
        """A Free while the daemon is away: do not claim these pages."""
        with self.lock:
            for i, seq in seqs.items():
                kept = self._keep.get(i)
                if kept is not None and kept[0] == seq:
                    self._deferred[i] = seq

    def claim(self, send: Callable[[list[int], list[int]], None]) -> list[int]:
        """Start a resume attempt: drop the deferred pages, then `send` the
        ADOPT records of the rest (under the lock, so no Free closes a
        descriptor being sent). Returns the ids claimed."""
        with self.lock:
            self._forget_locked(dict(self._deferred))
            ids = sorted(self._keep)
            send(ids, [self._keep[i][1] for i in ids])
            self._claimed = set(ids)
            return ids

    def late(self) -> dict[int, int]:
        """After a resume: pages freed while it was in flight (claimed, so
        the new daemon has them): free them there."""
        with self.lock:
            out = {i: seq for i, seq in self._deferred.items() if i in self._claimed}
            self._claimed = set()
            return out

    def ids(self) -> set[int]:
        with self.lock:
            return set(self._keep)

    def __len__(self) -> int:
        return len(self._keep)

    def close(self) -> None:
        with self.lock:
            fdchannel.close_fds(fd for _, fd in self._keep.values())
            self._keep.clear()
            self._deferred.clear()


class Resumer:
    """The resume loop of one session (runs on a thread of its own)."""

    def __init__(self, session_id: int, resume_token: bytes, keeper: Keeper, rpc: "Rpc", fd_socket: str, timeout: float,
                 connect: Callable[[], Channel], done: Callable[[Channel | None, "Opened | None", errors.KVCachedError | None], None],
                 closed: Callable[[], bool]):
        self.id = session_id
        self.token = resume_token
        self.keeper = keeper
        self.rpc = rpc
        self.fd_socket = fd_socket
        self.timeout = timeout
        self.connect = connect
        self.done = done
        self.closed = closed

    def start(self) -> None:
        threading.Thread(target=self.run, name=f"kvcached-resume-{self.id}", daemon=True).start()

    def run(self, give_up_after: float = 120.0) -> None:
        log.warning("session %d: the daemon went away; resuming (holding %d pages)", self.id, len(self.keeper))
        delay, deadline = FIRST_DELAY, time.monotonic() + give_up_after
        while not self.closed() and time.monotonic() < deadline:
            try:
                ch = self.connect()
            except errors.KVCachedError:
                time.sleep(delay)
                delay = min(delay * 2, MAX_DELAY)
                continue
            try:
                ids = self.keeper.claim(lambda ids, fds: ch.send_adopt(self.id, ids, fds))
                opened = self.rpc.resume_session(ch.hello.secret, self.id, self.token, ids)
            except (errors.Unavailable, errors.DeadlineExceeded, OSError):
                ch.close()
                time.sleep(delay)
                delay = min(delay * 2, MAX_DELAY)
                continue
            except errors.KVCachedError as exc:
                ch.close()
                err = errors.FailedPrecondition(f"session {self.id} could not be resumed after the daemon restarted: {exc.message}")
                log.error("%s", err.message)
                self.done(None, None, err)
                return
            log.warning("session %d resumed: %d pages adopted, %d forgotten", self.id, opened.pages_adopted, opened.pages_forgotten)
            self.done(ch, opened, None)
            return
        if self.closed():
            self.done(None, None, None)
            return
        self.done(None, None, errors.Unavailable(f"session {self.id}: the daemon did not come back within {give_up_after:g} s"))
