"""Sessions, and the port through which the core reaches a session's client.

A Session is the daemon's record of one client: its limits, the pages it
holds, its Watch queues (the core's books: daemon.py and this module are
the core). It reaches its client only through its SessionPort, which the fd
channel adapter (channel.py) implements: the kernel told the adapter who is
on the other end (SO_PEERCRED), so the port carries that identity, delivers
pages, and hangs up. The core never touches a socket. A session is bound to
its port once (OpenSession, ResumeSession) and takes the peer's pid, uid
and gid from it then: a request on that port needs no identity resolved.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from typing import Protocol

from ... import errors
from ..host import procs


class HeldPage(Protocol):
    """What a session knows of a page it holds: pool/pages.py's Page (the
    pool lends to sessions, so sessions.py does not import the pool)."""

    id: int
    device: str


class DeliveryFailed(Exception):
    """The port could not deliver pages (the client stopped reading, or its
    channel is gone)."""


class SessionPort(Protocol):
    """What the core needs from a session's transport: who the peer is,
    page delivery, and hanging up. One per session."""

    pid: int
    uid: int
    gid: int
    # ids of pages lent whose delivery waits for room in the channel (a
    # Free of one is refused: its client has not got it yet)
    delivering: set[int]

    @property
    def closed(self) -> bool: ...

    async def deliver(self, allocation_id: int, page_ids: list[int], fds: list[int]) -> None:
        """Hand the pages (ids and descriptors, in order) to the client
        before the request is answered; the caller keeps its descriptors.
        While it waits for room, the page ids are in `delivering`.
        Raises DeliveryFailed."""

    def hang_up(self, error: errors.KVCachedError | None, pages_returned: int = 0) -> None:
        """The session ended: tell the client (GOODBYE when error is None,
        else ERROR with it) and close. A no-op once closed."""

    def ask_drop(self, page_ids: list[int]) -> None:
        """Ask the client to let go of its kept handles of these pages (DROP
        records; it answers DROPPED, a request). Without waiting; a failed
        send ends the session."""

    def leave(self) -> None:
        """Close the channel without a word (a stop that the session
        outlives): the client takes it for the daemon going away, keeps its
        pages and resumes the session at the next start."""


@dataclass
class Adoption:
    """Pages a client re-sent (ADOPT records) on a new channel before
    ResumeSession, collected by the channel adapter: page id -> fd. The
    holder owns the fds: ResumeSession takes those it adopts, `discard`
    closes the rest."""

    session_id: int = 0
    fds: dict[int, int] = field(default_factory=dict)

    def take(self, page_id: int) -> int:
        return self.fds.pop(page_id)

    def discard(self) -> None:
        import os

        for fd in self.fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds.clear()


class PortDirectory(Protocol):
    """The fd channel adapter as the core sees it: channels not bound to a
    session yet, found by the one-time secret of their HELLO."""

    def find(self, secret: bytes) -> SessionPort:
        """The unbound port with this secret (InvalidArgument for a secret
        of the wrong size, FailedPrecondition for an unknown or used one)."""

    def bind(self, port: SessionPort, session: "Session") -> None:
        """The port now belongs to `session` (its secret is spent)."""

    def adoption(self, port: SessionPort) -> Adoption:
        """Every ADOPT record the client sent on this port so far."""

    def pause(self) -> None:
        """A stop the sessions outlive has begun: read no more requests and
        answer none with an error the stop caused; what is unread goes with
        the channel, as at a crash (the client resumes and asks again)."""

    def shutdown(self, error: errors.KVCachedError | None) -> None:
        """Close every channel still open and stop (daemon shutdown): with
        an ERROR record, or without a word (None: the sessions outlive the
        stop and resume at the next start)."""


@dataclass(eq=False)
class Session:
    id: int
    token: bytes
    name: str
    port: SessionPort
    admin: bool
    labels: dict[str, str]
    resume_hash: str = ""
    resume_token: bytes = b""  # set once at open, returned to the client, not kept anywhere else
    guaranteed_bytes: int = 0
    max_bytes: int = 0  # 0 = the device budget
    priority: int = 0
    pages: dict[int, "HeldPage"] = field(default_factory=dict)
    held_by_device: collections.Counter = field(default_factory=collections.Counter)
    standby_by_device: collections.Counter = field(default_factory=collections.Counter)  # of held: kept as standby
    opened_unix: float = field(default_factory=time.time)
    last_active_unix: float = field(default_factory=time.time)
    last_active: float = field(default_factory=time.monotonic)
    allocations_total: int = 0
    frees_total: int = 0
    reclaim_ignored: int = 0
    reclaim_requests: int = 0
    asks: dict = field(default_factory=dict)  # device uuid -> elastic.Ask
    idle_asked: bool = False
    closed: bool = False
    watchers: list[asyncio.Queue] = field(default_factory=list)
    # the port's peer as the kernel named it (SO_PEERCRED), taken once at binding
    pid: int = field(init=False)
    uid: int = field(init=False)
    gid: int = field(init=False)
    pstart: int = field(init=False)  # that process's start time (procs.py; 0: unknown), journaled with the pid

    def __post_init__(self) -> None:
        self.pid, self.uid, self.gid = self.port.pid, self.port.uid, self.port.gid
        self.pstart = procs.start_time(self.pid) or 0

    def touch(self) -> None:
        self.last_active_unix = time.time()
        self.last_active = time.monotonic()
        self.idle_asked = False

    def add_pages(self, pages: list["HeldPage"]) -> None:
        """Pages of one device, now the session's."""
        for p in pages:
            self.pages[p.id] = p
        if pages:
            self.held_by_device[pages[0].device] += len(pages)

    def book_loan(self, pages: list["HeldPage"]) -> int:
        """A loan of pages of one device, now the session's (`add_pages`),
        and the session active now (`touch`). Returns the pages it holds on
        that device: what the answer's held bytes say."""
        self.add_pages(pages)
        self.touch()
        return self.held_by_device[pages[0].device]

    def remove_pages(self, pages: list["HeldPage"]) -> None:
        """Pages of one device, no longer the session's."""
        for p in pages:
            del self.pages[p.id]
        if pages:
            self.held_by_device[pages[0].device] -= len(pages)

    def held_pages(self, uuid: str) -> int:
        return self.held_by_device.get(uuid, 0)

    def standby_pages(self, uuid: str | None = None) -> int:
        if uuid is None:
            return sum(self.standby_by_device.values())
        return self.standby_by_device.get(uuid, 0)

    def post(self, event) -> None:
        for q in self.watchers:
            q.put_nowait(event)


class Tombstones:
    """Recently closed session ids, to tell 'closed' from 'never existed'."""

    def __init__(self, capacity: int = 65536):
        self._d: collections.OrderedDict[int, str] = collections.OrderedDict()
        self._cap = capacity

    def add(self, sid: int, reason: str) -> None:
        self._d[sid] = reason
        while len(self._d) > self._cap:
            self._d.popitem(last=False)

    def get(self, sid: int) -> str | None:
        return self._d.get(sid)


def check_name(name: str) -> str:
    if not 1 <= len(name) <= 128 or not name.isprintable():
        raise errors.InvalidArgument(f"session name must be 1-128 printable characters, got {name!r:.140}")
    return name


def check_labels(labels: dict[str, str]) -> dict[str, str]:
    if len(labels) > 16:
        raise errors.InvalidArgument(f"at most 16 labels, got {len(labels)}")
    for k, v in labels.items():
        if not k or len(k.encode()) > 256 or len(v.encode()) > 256:
            raise errors.InvalidArgument(f"label keys must be 1-256 bytes and values up to 256 bytes: {k!r:.60}")
    return dict(labels)
