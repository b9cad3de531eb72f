"""relay.c through relay.py: the control socket's byte relay, alone (no
daemon). Each test hands it pairs of connected socketpairs' ends and talks
through it: "client" and "server" are the far ends a test holds."""

from __future__ import annotations

import os
import select
import socket
import threading
import time

import pytest

from kvcached_service.server.transports import relay as relay_mod


class Harness:
    def __init__(self):
        self.notify = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.relay = relay_mod.Relay(self.notify)
        self.ended: dict[int, str] = {}
        self._next = 0

    def pair(self, small: bool = False) -> tuple[int, socket.socket, socket.socket]:
        """A relayed connection: (its id, the client's end, grpcio's end).
        small: the relay's socket towards grpcio takes little (a Unix
        socket's sender holds what its peer has not read), so what grpcio
        does not read is soon kept in the relay."""
        client, client_inner = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        server_inner, server = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        if small:
            server_inner.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        self._next += 1
        self.relay.add(client_inner.detach(), server_inner.detach(), self._next)
        return self._next, client, server

    def wait_ended(self, conn_id: int, timeout: float = 5.0) -> str:
        deadline = time.monotonic() + timeout
        while conn_id not in self.ended:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"connection {conn_id} not reported ended in {timeout} s")
            select.select([self.notify], [], [], left)
            try:
                os.eventfd_read(self.notify)
            except BlockingIOError:
                pass
            self.ended.update(self.relay.ended())
        return self.ended[conn_id]

    def close(self) -> list[tuple[int, str]]:
        out = self.relay.close()
        os.close(self.notify)
        return out


@pytest.fixture
def h():
    harness = Harness()
    yield harness
    harness.close()


def recv_exactly(sock: socket.socket, n: int, timeout: float = 10.0) -> bytes:
    sock.settimeout(timeout)
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(min(1 << 20, n - len(out)))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def test_bytes_cross_both_ways_in_order(h):
    _, client, server = h.pair()
    for i in range(50):
        client.sendall(b"c%03d" % i)
        server.sendall(b"s%03d" % i)
    assert recv_exactly(server, 200) == b"".join(b"c%03d" % i for i in range(50))
    assert recv_exactly(client, 200) == b"".join(b"s%03d" % i for i in range(50))
    assert h.relay.count() == 1


def test_a_large_transfer_to_a_slow_reader_arrives_whole_and_is_held_back(h):
    """64 MiB to a reader that starts late: the writer blocks (flow control
    through the kernel's buffers, the relay keeps at most one read's worth),
    then every byte arrives in order."""
    _, client, server = h.pair()
    block = bytes(range(256)) * 4096  # 1 MiB
    total = 64
    sent = [0]

    def write():
        for _ in range(total):
            client.sendall(block)
            sent[0] += 1

    t = threading.Thread(target=write)
    t.start()
    time.sleep(0.5)
    assert sent[0] < total  # nobody reads grpcio's end: the writer is held back
    got = 0
    server.settimeout(10)
    while got < total * len(block):
        chunk = server.recv(1 << 20)
        assert chunk, "closed early"
        assert chunk == (block * 2)[got % len(block):got % len(block) + len(chunk)]
        got += len(chunk)
    t.join(10)
    assert sent[0] == total


def test_a_client_that_closes_is_reported_and_its_last_bytes_arrive(h):
    conn_id, client, server = h.pair()
    client.sendall(b"last words")
    client.close()
    assert h.wait_ended(conn_id) == "client closed"
    assert recv_exactly(server, 100) == b"last words"  # then EOF
    assert server.recv(10) == b""


def test_grpcio_closing_is_reported_and_its_goaway_is_delivered_first(h):
    """grpcio writes a GOAWAY and closes while the client is not reading:
    the relay writes the kept bytes to the client, then closes it."""
    conn_id, client, server = h.pair()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    payload = os.urandom(2 << 20)  # more than the client's buffers take: some is kept in the relay
    t = threading.Thread(target=server.sendall, args=(payload,))
    t.start()
    time.sleep(0.3)
    assert recv_exactly(client, len(payload)) == payload
    t.join(10)
    server.close()
    assert h.wait_ended(conn_id) == "server closed"
    assert client.recv(10) == b""


def test_a_side_that_never_takes_the_rest_is_closed_after_the_flush_deadline(h):
    """A client sends more than grpcio reads and leaves: the relay keeps
    what grpcio cannot take yet and stops reading the client; the client's
    hang-up starts a clock, and the connection is closed at its deadline
    (relay.c's FLUSH_NS, 5 s), not kept for ever with its buffer. A grpcio
    that does read within it gets every byte first."""
    def fill(client):
        client.setblocking(False)
        n = 0
        try:
            while True:
                n += client.send(b"x" * 65536)
        except BlockingIOError:
            pass
        return n

    conn_id, client, server = h.pair(small=True)
    fill(client)
    time.sleep(0.2)
    client.close()
    t0 = time.monotonic()
    assert h.wait_ended(conn_id, timeout=10) == "client closed"
    assert 4.0 < time.monotonic() - t0 < 8.0
    server.close()

    conn_id, client, server = h.pair(small=True)
    sent = fill(client)
    time.sleep(0.2)
    client.close()
    time.sleep(1.0)
    assert recv_exactly(server, sent) == b"x" * sent  # read within the deadline: all of it
    assert h.wait_ended(conn_id) == "client closed"
    assert server.recv(10) == b""


def test_a_reset_peer_ends_the_connection_at_once(h):
    conn_id, client, server = h.pair()
    server.close()  # grpcio went away
    assert h.wait_ended(conn_id) in ("server closed", "error")
    client.settimeout(5)
    assert client.recv(10) == b""


def test_stopping_closes_every_connection_and_reports_it():
    harness = Harness()
    pairs = [harness.pair() for _ in range(20)]
    time.sleep(0.1)
    ended = dict(harness.close())
    assert sorted(ended) == [p[0] for p in pairs] and set(ended.values()) == {"daemon stopping"}
    for _, client, server in pairs:
        client.settimeout(5)
        assert client.recv(10) == b""
        client.close()
        server.close()
    a, b = socket.socketpair()
    with pytest.raises(OSError, match="stopped"):
        harness.relay.add(a.detach(), b.detach(), 99)  # and it closes both


def test_many_connections_churn_without_leaking_fds(h):
    """2,000 connections opened, used and closed, 200 at a time: every one
    is reported, and the process has as many fds as before."""
    fds_before = len(os.listdir("/proc/self/fd"))
    for _ in range(10):
        batch = [h.pair() for _ in range(200)]
        for _, client, server in batch:
            client.sendall(b"ping")
        for _, client, server in batch:
            assert recv_exactly(server, 4) == b"ping"
            server.sendall(b"pong")
        for conn_id, client, server in batch:
            assert recv_exactly(client, 4) == b"pong"
            client.close()
        for conn_id, client, server in batch:
            h.wait_ended(conn_id)
            server.close()
    assert len(h.ended) == 2000 and h.relay.count() == 0
    assert len(os.listdir("/proc/self/fd")) == fds_before


def test_a_missing_library_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(relay_mod, "_LIB", None)
    monkeypatch.setattr(relay_mod, "library_path", lambda: None)
    with pytest.raises(relay_mod.RelayUnavailable, match="not built.*pip install"):
        relay_mod.check()
