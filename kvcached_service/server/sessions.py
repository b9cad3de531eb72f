"""Sessions and their fd channels.

A Channel is one accepted connection on the fd socket: the kernel tells us
who is on the other end (SO_PEERCRED), and the connection is the session's
liveness. A Session is bound to exactly one channel by OpenSession.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import os
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .. import errors, fdchannel

if TYPE_CHECKING:
    from .pool import DevicePool, Page


class ChannelClosed(Exception):
    pass


class Channel:
    """The daemon's end of one fd channel connection."""

    def __init__(self, channel_id: int, sock: socket.socket, pid: int, uid: int, gid: int, secret: bytes):
        self.id = channel_id
        self.sock = sock
        self.pid, self.uid, self.gid = pid, uid, gid
        self.secret = secret
        self.pidfd: int | None = None
        self.session: "Session | None" = None
        self.closed = False
        self.created = time.monotonic()
        self._send_lock = asyncio.Lock()
        # ADOPT records received before ResumeSession: page id -> fd
        self.adopted: dict[int, int] = {}
        self.adopt_session = 0

    def fileno(self) -> int:
        return self.sock.fileno()

    async def send(self, data: bytes, fds: list[int], timeout: float) -> None:
        """Send one record without blocking the loop; waits for room up to
        `timeout` seconds. Raises ChannelClosed when it cannot deliver."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        async with self._send_lock:
            while True:
                if self.closed:
                    raise ChannelClosed("channel closed")
                try:
                    fdchannel.send_record(self.sock, data, fds)
                    return
                except BlockingIOError:
                    pass
                except OSError as exc:
                    if exc.errno in (errno.EAGAIN, errno.ENOBUFS):
                        pass
                    else:
                        raise ChannelClosed(f"send failed: {exc.strerror}") from exc
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise ChannelClosed(f"client did not read its fd channel for {timeout:g} s")
                await self._writable(min(remaining, 0.05))

    async def _writable(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        fd = self.sock.fileno()
        loop.add_writer(fd, lambda: fut.done() or fut.set_result(None))
        try:
            await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            loop.remove_writer(fd)

    def send_nowait(self, data: bytes) -> None:
        """Best effort (GOODBYE / ERROR before closing)."""
        try:
            fdchannel.send_record(self.sock, data)
        except OSError:
            pass

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        fdchannel.close_fds(self.adopted.values())
        self.adopted.clear()
        loop = asyncio.get_event_loop()
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


@dataclass(eq=False)
class Session:
    id: int
    token: bytes
    name: str
    channel: Channel
    admin: bool
    labels: dict[str, str]
    resume_hash: str = ""
    resume_token: bytes = b""  # set once at open, returned to the client, not kept anywhere else
    guaranteed_bytes: int = 0
    max_bytes: int = 0  # 0 = the device budget
    priority: int = 0
    pages: dict[int, "Page"] = field(default_factory=dict)
    held_by_device: collections.Counter = field(default_factory=collections.Counter)
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

    @property
    def uid(self) -> int:
        return self.channel.uid

    @property
    def pid(self) -> int:
        return self.channel.pid

    @property
    def gid(self) -> int:
        return self.channel.gid

    def touch(self) -> None:
        self.last_active_unix = time.time()
        self.last_active = time.monotonic()
        self.idle_asked = False

    def add_pages(self, pool: "DevicePool", pages: list["Page"]) -> None:
        for p in pages:
            self.pages[p.id] = p
        self.held_by_device[pool.uuid] += len(pages)

    def remove_pages(self, pool: "DevicePool", pages: list["Page"]) -> None:
        for p in pages:
            del self.pages[p.id]
        self.held_by_device[pool.uuid] -= len(pages)

    def held_pages(self, uuid: str) -> int:
        return self.held_by_device.get(uuid, 0)

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
