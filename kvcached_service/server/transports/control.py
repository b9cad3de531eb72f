"""The control socket's front door: who may hold gRPC connections, and who
is calling.

grpcio accepts connections itself and tells a servicer nothing about the
peer of a Unix socket (no SO_PEERCRED), so the daemon does not let it listen
on the control socket. This module listens there instead, and for every
connection:

- reads the peer's credentials from the kernel (SO_PEERCRED);
- admits it or refuses it: at most `max_grpc_connections` open at once, at
  most `max_grpc_connections_per_uid` per uid (one uid cannot take the
  slots of another), and uids that are not admins (`admin_uids`, the
  daemon's own uid) together at most `max_grpc_connections` less
  `grpc_admin_reserve`: unprivileged uids that fill every slot they can
  never lock out an operator's `kvcachedctl` or the health probe. A refused
  connection's first call is answered RESOURCE_EXHAUSTED naming the limit
  (a trailers-only gRPC answer, then GOAWAY), then it is closed (at once
  when 64 refusals are already being answered: a flood gets the door, not
  words); counted (`refused`), logged (once per uid per minute);
- connects a socket of its own to grpcio, which listens on a private socket
  in a 0700 directory only the daemon's uid (and root) can reach, and hands
  both sockets to relay.c (relay.py), which copies the bytes both ways in a
  thread of its own: no byte of gRPC passes through Python, and gRPC itself,
  health and reflection are unchanged;
- names the connection to grpcio: the daemon's socket towards grpcio is
  bound to a random abstract name, which the servicer sees as
  `context.peer()` ("unix-abstract:kvcached-..."): `peer(context.peer())`
  returns the kernel's credentials of the real caller. That is how a
  SessionRef is bound to the uid that opened the session (service.py,
  identity.py).

Connections with no call in flight are closed by grpcio after
`grpc_idle_timeout` (grpc.max_connection_idle_ms); clients reconnect on
their next call. When either side closes, relay.c closes the other (after
writing what it still kept for it) and tells this module, which forgets it.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import os
import secrets
import shutil
import socket
import stat
import struct
import tempfile
import time
from dataclasses import dataclass

from ... import fdchannel
from . import relay
from ...config import Settings
from ..host.sockets import apply_socket_permissions, prepare_socket_path

log = logging.getLogger("kvcached.control")

_BACKLOG = 4096  # connections the kernel queues before accept (the kernel caps it at net.core.somaxconn)
_RESOURCE_EXHAUSTED = 8
_REFUSAL_WAIT = 0.5  # seconds a refused connection has to send its first call and read the answer
_REFUSALS_AT_ONCE = 64  # refused connections being answered at once; beyond, they are closed at once


@dataclass(frozen=True)
class Peer:
    """A control connection's client as the kernel names it."""

    pid: int
    uid: int
    gid: int


GONE = Peer(0, -1, -1)  # the caller of a relay that closed: matches no session's uid


_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SERVER_PREFACE = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # an empty SETTINGS frame


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _hpack_literal(name: bytes, value: bytes) -> bytes:
    """A header field as a literal without indexing, new name, no Huffman."""
    return b"\x00" + _hpack_int(len(name), 7) + name + _hpack_int(len(value), 7) + value


def grpc_refusal(stream_id: int, code: int, message: str) -> bytes:
    """What a refused gRPC client reads: the server's SETTINGS, a trailers-only
    answer to its first call (gRPC status `code` and `message`, percent-encoded
    as gRPC wants), and a GOAWAY. The server's SETTINGS (SERVER_PREFACE)
    must have been sent first: a gRPC client sends no call before it."""
    msg = "".join(c if 0x20 <= ord(c) < 0x7F and c != "%" else "".join(f"%{b:02X}" for b in c.encode()) for c in message)
    block = (_hpack_literal(b":status", b"200") + _hpack_literal(b"content-type", b"application/grpc")
             + _hpack_literal(b"grpc-status", str(code).encode()) + _hpack_literal(b"grpc-message", msg.encode()))
    return (_frame(0x4, 0x1, 0, b"")  # the ACK of the client's SETTINGS (ours went first: SERVER_PREFACE)
            + _frame(0x1, 0x4 | 0x1, stream_id, block)  # HEADERS: END_HEADERS | END_STREAM
            + _frame(0x7, 0, 0, struct.pack(">II", stream_id, 0) + message.encode()[:1000]))


def first_call(data: bytes) -> int | None:
    """The stream id of the first HEADERS frame after the client preface,
    None until it has arrived; -1 when the bytes are not HTTP/2."""
    if len(data) < len(_PREFACE):
        return None if _PREFACE.startswith(data) else -1
    if not data.startswith(_PREFACE):
        return -1
    i = len(_PREFACE)
    while len(data) - i >= 9:
        length = int.from_bytes(data[i:i + 3], "big")
        kind = data[i + 3]
        stream = int.from_bytes(data[i + 5:i + 9], "big") & 0x7FFFFFFF
        if kind == 0x1 and stream:
            return stream
        i += 9 + length
    return None


async def _unix_connect(sock: socket.socket, path: str, patience: float = 5.0) -> None:
    """connect(2) of a non-blocking Unix stream socket, waiting while the
    listener's backlog is full. Not `loop.sock_connect`: a Unix socket
    answers a full backlog with EAGAIN, which asyncio takes for a connect in
    progress and then reports as done, leaving a socket that is not
    connected (its first write fails with ENOTCONN)."""
    deadline = time.monotonic() + patience
    delay = 0.001
    while True:
        try:
            sock.connect(path)
            return
        except (BlockingIOError, InterruptedError):
            if time.monotonic() >= deadline:
                raise OSError(errno.EAGAIN, f"{path}: its backlog stayed full for {patience:g} s") from None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)


def _remove_reader(fd: int) -> None:
    """Stop watching fd, when a loop runs (when it is gone, so is its watch)."""
    try:
        asyncio.get_running_loop().remove_reader(fd)
    except RuntimeError:
        pass


@dataclass
class _Conn:
    """An admitted control connection (relayed by relay.c once grpcio's side is up)."""

    id: int
    name: str  # its socket's abstract name towards grpcio, as grpcio reports the peer
    peer: Peer
    opened: float


class ControlFront:
    """The control socket's listener and admission; relay.c relays (see the module doc)."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.path = settings.socket
        relay.check()  # the library is built and loads (RelayUnavailable says how to build it)
        self._dir = self._private_dir(settings.socket)
        self.private_path = os.path.join(self._dir, "grpc.sock")
        self._listener: socket.socket | None = None
        self._relay: relay.Relay | None = None
        self._notify = -1  # the eventfd relay.c writes when connections end
        self._conns: dict[str, _Conn] = {}  # by the name grpcio reports
        self._by_id: dict[int, _Conn] = {}
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Future] = set()
        self._by_uid: dict[int, int] = {}
        self._open = 0
        self._open_unprivileged = 0  # of _open: connections of uids that are not admins
        self._last_warning: dict[int, float] = {}
        self._answering = 0  # refused connections waiting for their first call (_Refusal)
        self.refused = {"per_uid": 0, "total": 0}
        self.accepted_total = 0
        self.closed_by_server_total = 0  # grpcio closed it first (idle, or shutting down)

    @staticmethod
    def _private_dir(socket_path: str) -> str:
        """A 0700 directory for grpcio's own socket: `.<socket name>.grpc`
        beside the control socket (writable wherever the socket is, e.g.
        /run/kvcached under systemd; one left by a daemon that was killed is
        replaced, as main.py checked that no daemon serves that socket), or a
        fresh one in the temporary directory when that path would be too long
        for a Unix socket."""
        parent, name = os.path.split(os.path.abspath(socket_path))
        d = os.path.join(parent, f".{name}.grpc")
        if len(os.path.join(d, "grpc.sock").encode()) < 100:
            try:
                st = os.lstat(d)
            except FileNotFoundError:
                pass
            else:
                if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                    raise OSError(f"{d} exists and is not a directory of this uid; remove it")
                shutil.rmtree(d)  # a killed daemon's
            os.mkdir(d, 0o700)
            return d
        return tempfile.mkdtemp(prefix="kvcached-grpc-")

    # ---- life cycle -----------------------------------------------------
    async def start(self) -> None:
        """Listen on the control socket (grpcio must already serve the
        private one). The socket file is born private, then gets the
        configured mode and group."""
        loop = asyncio.get_running_loop()
        self._notify = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._relay = relay.Relay(self._notify)
        loop.add_reader(self._notify, self._reap)
        prepare_socket_path(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        old_umask = os.umask(0o177)
        try:
            sock.bind(self.path)
        finally:
            os.umask(old_umask)
        apply_socket_permissions(self.path, self.settings)
        sock.listen(_BACKLOG)  # connections the kernel queues before accept (capped at net.core.somaxconn)
        self._listener = sock
        loop.add_reader(sock.fileno(), self._accept)

    def stop_accepting(self) -> None:
        if self._listener is not None:
            _remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None

    def close(self) -> None:
        """Stop listening, close every relayed connection, remove the files."""
        self.stop_accepting()
        if self._relay is not None:
            for conn_id, why in self._relay.close():
                self._forget(conn_id, why)
            self._relay = None
        for conn in list(self._by_id.values()):  # still connecting to grpcio: their tasks close their sockets
            self._forget(conn.id, "daemon stopping")
        if self._notify >= 0:
            _remove_reader(self._notify)
            os.close(self._notify)
            self._notify = -1
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        shutil.rmtree(self._dir, ignore_errors=True)

    # ---- who is calling ---------------------------------------------------
    def peer(self, grpc_peer: str) -> Peer | None:
        """The kernel's credentials of the client behind a gRPC call
        (`context.peer()`); None for a connection that did not come through
        this front door (only the daemon's own uid and root can make one).
        A connection that is already gone (its client closed it while a
        call of it was still being served) is GONE: no uid, so no
        SessionRef is good for it (fail closed)."""
        prefix = "unix-abstract:kvcached-"
        if not grpc_peer.startswith(prefix):
            return None
        conn = self._conns.get(grpc_peer[len("unix-abstract:"):])
        return conn.peer if conn is not None else GONE

    def stats(self) -> dict:
        return {"open": self._open, "uids": len(self._by_uid), "refused": dict(self.refused),
                "accepted": self.accepted_total, "closed_by_server": self.closed_by_server_total}

    # ---- accepting ----------------------------------------------------------
    def _accept(self) -> None:
        """The listener is readable: admit or refuse what waits (a batch, so
        that the loop's other work goes on during a flood)."""
        for _ in range(64):
            if self._listener is None:
                return
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of fds, most likely: wait a little, as asyncio's own servers do
                log.error("control socket: accept failed: %s; accepting again in 1 s", exc)
                loop = asyncio.get_running_loop()
                loop.remove_reader(self._listener.fileno())
                loop.call_later(1.0, self._resume_accepting)
                return
            try:
                self._admit(sock)
            except OSError as exc:  # the peer went away before we looked
                log.debug("control connection gone before admission: %s", exc)
                sock.close()

    def _resume_accepting(self) -> None:
        if self._listener is not None:
            asyncio.get_running_loop().add_reader(self._listener.fileno(), self._accept)

    def _admit(self, sock: socket.socket) -> None:
        pid, uid, gid = fdchannel.peer_credentials(sock)
        peer = Peer(pid, uid, gid)
        reason = self._refusal(uid)
        if reason is not None:
            kind, text = reason
            self.refused[kind] += 1
            now = time.monotonic()
            if now - self._last_warning.get(uid, -1e9) >= 60:
                self._last_warning[uid] = now
                log.warning("refused a control connection from pid %d uid %d: %s (refused so far: %d per uid, %d in total)",
                            pid, uid, text, self.refused["per_uid"], self.refused["total"])
            if self._answering < _REFUSALS_AT_ONCE:
                self._spawn(self._answer(_Refusal(self, f"kvcached: {text}"), sock))
            else:
                sock.close()  # a flood: no answer, just the door
            return
        conn = _Conn(next(self._ids), "kvcached-" + secrets.token_hex(12), peer, time.monotonic())
        self._conns[conn.name] = conn
        self._by_id[conn.id] = conn
        self._by_uid[uid] = self._by_uid.get(uid, 0) + 1
        self._open += 1
        if not self.settings.is_admin(uid):
            self._open_unprivileged += 1
        self.accepted_total += 1
        self._spawn(self._connect(conn, sock))

    @staticmethod
    async def _answer(refusal: "_Refusal", sock: socket.socket) -> None:
        try:
            await asyncio.get_running_loop().connect_accepted_socket(lambda: refusal, sock)
        except OSError as exc:
            log.debug("refused control connection gone before its answer: %s", exc)
            sock.close()
            refusal._finish()

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self._tasks.discard)

    def _refusal(self, uid: int) -> tuple[str, str] | None:
        s = self.settings
        mine = self._by_uid.get(uid, 0)
        if mine >= s.max_grpc_connections_per_uid:
            return "per_uid", f"uid {uid} already has {mine} control connections open (max_grpc_connections_per_uid={s.max_grpc_connections_per_uid})"
        if self._open >= s.max_grpc_connections:
            return "total", f"the daemon already has {self._open} control connections open (max_grpc_connections={s.max_grpc_connections})"
        shared = s.max_grpc_connections - s.grpc_admin_reserve
        if self._open_unprivileged >= shared and not s.is_admin(uid):
            return "total", (f"the daemon already has {self._open_unprivileged} control connections of non-admin uids open "
                             f"(max_grpc_connections={s.max_grpc_connections} less grpc_admin_reserve={s.grpc_admin_reserve})")
        return None

    async def _connect(self, conn: _Conn, client: socket.socket) -> None:
        """Connect to grpcio from a socket named after the connection, then
        hand both sockets to relay.c. Nobody has read a byte of the client
        yet: whatever it sent waits in its socket, in order."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        try:
            s.bind(b"\0" + conn.name.encode())
            await _unix_connect(s, self.private_path)
        except OSError as exc:
            s.close()
            client.close()
            log.error("control connection from pid %d uid %d: cannot reach the gRPC server: %s", conn.peer.pid, conn.peer.uid, exc)
            self._forget(conn.id, "private side failed")
            return
        if self._relay is None or conn.id not in self._by_id:  # the daemon is stopping
            s.close()
            client.close()
            self._forget(conn.id, "daemon stopping")
            return
        try:
            self._relay.add(client.detach(), s.detach(), conn.id)  # relay.c owns both now
        except OSError as exc:
            log.error("control connection from pid %d uid %d: the relay refused it: %s", conn.peer.pid, conn.peer.uid, exc)
            self._forget(conn.id, "relay failed")

    def _reap(self) -> None:
        """relay.c says connections ended."""
        try:
            os.eventfd_read(self._notify)
        except BlockingIOError:
            pass
        if self._relay is not None:
            for conn_id, why in self._relay.ended():
                self._forget(conn_id, why)

    def _forget(self, conn_id: int, why: str) -> None:
        conn = self._by_id.pop(conn_id, None)
        if conn is None:
            return
        del self._conns[conn.name]
        self._open -= 1
        if not self.settings.is_admin(conn.peer.uid):
            self._open_unprivileged -= 1
        n = self._by_uid.get(conn.peer.uid, 0) - 1
        if n > 0:
            self._by_uid[conn.peer.uid] = n
        else:
            self._by_uid.pop(conn.peer.uid, None)
        if why.startswith("server"):
            self.closed_by_server_total += 1
        log.debug("control connection from pid %d uid %d ended after %.1f s (%s)", conn.peer.pid, conn.peer.uid,
                  time.monotonic() - conn.opened, why)


class _Refusal(asyncio.Protocol):
    """A refused connection: its first call is answered RESOURCE_EXHAUSTED
    with the limit in the message (so a gRPC client reports what happened and
    does not reconnect in a loop), then it is closed; within _REFUSAL_WAIT."""

    def __init__(self, front: ControlFront, message: str):
        self.front = front
        self.message = message
        self.transport: asyncio.Transport | None = None
        self.data = b""
        self.done = False
        self._timer: asyncio.TimerHandle | None = None
        front._answering += 1  # now: the count bounds the refusals still being set up too

    def connection_made(self, transport) -> None:
        self.transport = transport
        if self.done:
            transport.close()
            return
        self._timer = asyncio.get_running_loop().call_later(_REFUSAL_WAIT, self._finish)
        transport.write(SERVER_PREFACE)

    def data_received(self, data: bytes) -> None:
        if self.done:
            return
        self.data += data
        stream = first_call(self.data)
        if stream is None and len(self.data) < 65536:
            return
        if stream is not None and stream > 0:
            self.transport.write(grpc_refusal(stream, _RESOURCE_EXHAUSTED, self.message))
        self._finish()

    def _finish(self) -> None:
        if not self.done:
            self.done = True
            if self._timer is not None:
                self._timer.cancel()
            self.front._answering -= 1
            if self.transport is not None:
                self.transport.close()

    def eof_received(self) -> bool:
        self._finish()
        return False

    def connection_lost(self, exc) -> None:
        self._finish()
