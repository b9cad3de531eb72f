"""Unit tests: settings, generated code freshness, the pool's accounting
with a fake backend, and admission. (The error taxonomy: test_errors.py;
the fd channel codec against the wire spec: test_fdchannel.py.)"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys

import pytest

from kvtest import ROOT
from kvcached_service import errors
from kvcached_service.backends.base import Backend, DeviceSpec, PageHandle
from kvcached_service.backends.host import HostBackend
from kvcached_service.config import ConfigError, MemoryLimit, load_settings, parse_size


# ---- settings -----------------------------------------------------------------
def test_sizes():
    assert parse_size("2MiB") == 2 << 20
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("4096") == 4096
    for bad in ("lots", "-1", "2XB", ""):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_memory_limit_is_parsed_once_and_resolved_per_device():
    half = MemoryLimit.parse("50%")
    assert (half.resolve(1000), half.resolve(4096)) == (500, 2048)  # the same limit, two devices
    fixed = MemoryLimit.parse("8GiB")
    assert fixed.resolve(1 << 40) == fixed.resolve(1 << 30) == 8 << 30  # bytes do not depend on the device
    for bad in ("150%", "0%", "x%", "0", "lots"):
        with pytest.raises(ValueError):
            MemoryLimit.parse(bad)
    s = load_settings({"memory_limit": "25%"})
    assert s.memory_limit == "25%" and s.memory_limit_value.resolve(400) == 100  # parsed at validation
    with pytest.raises(ConfigError, match="memory_limit.*percentage"):
        load_settings({"memory_limit": "101%"})


def test_precedence_cli_env_file(tmp_path, monkeypatch):
    cfg = tmp_path / "c.toml"
    cfg.write_text('memory_limit = "1GiB"\npage_size = "4MiB"\nprealloc = "8MiB"\n')
    monkeypatch.setenv("KVCACHED_PAGE_SIZE", "8MiB")
    monkeypatch.setenv("KVCACHED_PREALLOC", "16MiB")
    s = load_settings({"prealloc": "32MiB"}, str(cfg))
    assert s.memory_limit == "1GiB"  # file
    assert s.page_size == "8MiB"  # env over file
    assert s.prealloc == "32MiB"  # flag over env


def test_invalid_settings_name_the_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHED_SOCKET_MODE", "999")
    with pytest.raises(ConfigError) as info:
        load_settings({"metrics_address": "nowhere"})
    text = str(info.value)
    assert "socket_mode" in text and "KVCACHED_SOCKET_MODE" in text
    assert "metrics_address" in text and "host:port" in text
    with pytest.raises(ConfigError, match="config file not found"):
        load_settings({}, str(tmp_path / "missing.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("this is = = not toml")
    with pytest.raises(ConfigError):
        load_settings({}, str(bad))
    (tmp_path / "extra.toml").write_text('bogus_setting = 1\n')
    with pytest.raises(ConfigError, match="bogus_setting"):
        load_settings({}, str(tmp_path / "extra.toml"))


def test_uid_lists_from_env(monkeypatch):
    monkeypatch.setenv("KVCACHED_ALLOWED_UIDS", "1000, 1001")
    assert load_settings({}).allowed_uids == [1000, 1001]


def test_generated_python_is_up_to_date():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---- host backend ---------------------------------------------------------------
def test_host_pages_are_sealed_and_zeroable():
    import mmap

    b = HostBackend(1 << 30)
    (page,) = b.create_pages(0, 1, 1 << 21, zero=True)
    m = mmap.mmap(page.fd, 1 << 21)
    m[:4] = b"data"
    with pytest.raises(OSError):
        os.ftruncate(page.fd, 0)  # sealed: nobody can shrink a page under a mapping
    b.zero_pages(0, [page])
    assert m[:4] == b"\0\0\0\0"  # punching the hole zeroes every mapping
    m.close()
    b.release_pages(0, [page])
    assert page.fd == -1


# ---- pool accounting with a fake backend ---------------------------------------
class FakeBackend(Backend):
    kind = "fake"

    def __init__(self, fail_create_at: int = 0):
        self.live = 0
        self.calls = 0
        self.fail_create_at = fail_create_at

    def devices(self):
        return [DeviceSpec("FAKE-0", "fake", "host", 0, 1 << 40, 4096)]

    def create_pages(self, device, count, page_size, zero):
        self.calls += 1
        if self.calls == self.fail_create_at:
            raise errors.Internal("CUDA_ERROR_UNKNOWN (injected)")
        self.live += count
        return [PageHandle(fd=1000 + i, size=page_size) for i in range(count)]

    def zero_pages(self, device, pages):
        pass

    def release_pages(self, device, pages):
        self.live -= len(pages)

    def adopt_pages(self, device, fds, page_size):
        self.live += len(fds)
        return [PageHandle(fd=fd, size=page_size) for fd in fds]


def _pool(backend, budget_pages=16, warm=0, page_ids=None):
    from kvcached_service.server.core.pool import DevicePool, PageIds
    from kvcached_service.server.core.worker import DeviceWorker

    w = DeviceWorker(backend, 0, "fake")
    w.start()
    return DevicePool(backend, backend.devices()[0], w, page_ids=page_ids or PageIds(), page_size=4096,
                      budget_bytes=budget_pages * 4096, warm_pages=warm, idle_seconds=0, zero_pages=True)


class _S:
    def __init__(self, sid, uid):
        self.id, self.uid, self.name = sid, uid, f"s{sid}"


def test_pool_books_and_uid_partitioning():
    async def run():
        be = FakeBackend()
        pool = _pool(be)
        a, b = _S(1, 1000), _S(2, 2000)
        pa = await pool.acquire(a, 10)
        pool.check()
        bk = pool.books()
        assert (bk.in_use, bk.free) == (10, 6)
        await pool.give_back(pa)
        pool.check()
        assert pool.books().pooled == 10 and pool.n_ready_for(1000) == 10 and pool.n_ready_for(2000) == 0
        # uid 2000 needs 16: 6 from free budget, 10 by releasing uid 1000's pooled pages
        pb_ = await pool.acquire(b, 16)
        assert not {p.id for p in pa} & {p.id for p in pb_}
        assert pool.counters.released_total == 10 and be.live == 16
        pool.check()
        with pytest.raises(errors.ResourceExhausted, match="cannot allocate 1 pages"):
            await pool.acquire(a, 1)
        await pool.give_back(pb_)
        # same uid gets its own pages back without creating new ones
        created = pool.counters.created_total
        again = await pool.acquire(b, 16)
        assert pool.counters.created_total == created
        assert {p.id for p in again} == {p.id for p in pb_}
        pool.worker.stop()

    asyncio.run(run())


def test_pool_rolls_back_when_create_fails():
    async def run():
        be = FakeBackend(fail_create_at=2)
        pool = _pool(be)
        s = _S(1, 1)
        first = await pool.acquire(s, 4)
        await pool.give_back(first)
        with pytest.raises(errors.Internal, match="injected"):
            await pool.acquire(s, 8)  # 4 ready + 4 to create: the create fails
        pool.check()
        assert pool.n_ready_for(1) == 4 and pool.books().in_use == 0 and pool.books().free == 12
        pool.worker.stop()

    asyncio.run(run())


def test_pool_makes_a_large_allocation_in_batches_and_never_leaks_one():
    """An Allocate's new pages are made CREATE_BATCH per worker call (other
    calls run between them); when a batch fails, or the caller is cancelled
    with a batch in flight, every page made so far is released."""
    import time as _time

    from kvcached_service.server.core.pool import CREATE_BATCH

    async def drain(pool):
        for _ in range(3):  # releases are queued on the worker
            await pool.worker.call(lambda: None)
            await asyncio.sleep(0)

    async def run():
        be = FakeBackend()
        pool = _pool(be, budget_pages=300)
        s = _S(1, 1)
        pages = await pool.acquire(s, 200)
        assert len(pages) == 200 and be.calls == -(-200 // CREATE_BATCH) and be.live == 200
        pool.check()
        pool.worker.stop()

        be = FakeBackend(fail_create_at=3)  # the third batch fails
        pool = _pool(be, budget_pages=300)
        with pytest.raises(errors.Internal, match="injected"):
            await pool.acquire(s, 200)
        await drain(pool)
        assert be.live == 0 and pool.books().in_use == 0 and pool.books().free == 300
        pool.check()
        pool.worker.stop()

        class Slow(FakeBackend):
            def create_pages(self, device, count, page_size, zero):
                _time.sleep(0.05)
                return super().create_pages(device, count, page_size, zero)

        be = Slow()
        pool = _pool(be, budget_pages=300)
        task = asyncio.ensure_future(pool.acquire(s, 200))
        await asyncio.sleep(0.075)  # the first batch made, the second in flight
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.1)  # the batch in flight ends, then its release is queued
        await drain(pool)
        assert be.calls == 2 and be.live == 0, (be.calls, be.live)
        assert pool.books().in_use == 0 and pool.books().free == 300
        pool.check()
        pool.worker.stop()

    asyncio.run(run())


def test_pool_warm_pages_and_idle_trim():
    async def run():
        be = FakeBackend()
        pool = _pool(be, warm=4)
        await pool.prefill()
        assert pool.books().pooled == 4
        s = _S(1, 1)
        pages = await pool.acquire(s, 8)
        await asyncio.sleep(0.05)  # background refill
        assert pool.n_ready_total() == 4
        await pool.give_back(pages)
        assert pool.books().pooled == 12
        released = await pool.trim_idle()
        assert released == 8 and pool.books().pooled == 4  # back to the warm target
        pool.check()
        pool.worker.stop()

    asyncio.run(run())


def test_books_are_a_frozen_snapshot():
    import dataclasses

    async def run():
        be = FakeBackend()
        pool = _pool(be)
        before = pool.books()
        got = await pool.acquire(_S(1, 1), 3)
        after = pool.books()
        assert (before.in_use, after.in_use) == (0, 3)  # the first snapshot did not move
        assert after.budget_bytes == 16 * 4096 and after.in_use_bytes == 3 * 4096
        with pytest.raises(dataclasses.FrozenInstanceError):
            after.in_use = 0
        await pool.give_back(got)
        pool.worker.stop()

    asyncio.run(run())


def test_page_ids_are_shared_by_pools_and_continue_after_a_restart():
    from kvcached_service.server.core.pool import PageIds

    async def run():
        ids = PageIds()
        ids.continue_from(100)  # the journal knew ids below 100
        a, b = _pool(FakeBackend(), page_ids=ids), _pool(FakeBackend(), page_ids=ids)
        pa = await a.acquire(_S(1, 1), 2)
        pb_ = await b.acquire(_S(2, 1), 2)
        assert [p.id for p in pa] == [100, 101] and [p.id for p in pb_] == [102, 103]
        ids.continue_from(50)  # never backwards
        assert ids.peek() == 104
        for pool in (a, b):
            pool.worker.stop()

    asyncio.run(run())


def test_orphans_and_adoption_go_through_the_pool():
    """A previous daemon's pages count as in use while their session may
    resume; adopting them changes no count, forgetting frees the budget."""

    async def run():
        be = FakeBackend()
        pool = _pool(be)
        pool.hold_orphans(5)
        pool.check()
        assert (pool.books().in_use, pool.books().free) == (5, 11)
        handles = await pool.import_pages([50, 51, 52])
        s = _S(7, 1000)
        pages = pool.adopt(s, [(9, handles[0], "a"), (10, handles[1], "b"), (11, handles[2], "c")])
        assert [p.id for p in pages] == [9, 10, 11] and all(p.session is s and p.uid == 1000 for p in pages)
        pool.forget_orphans(2)  # the two pages the client did not claim
        pool.check()
        assert (pool.books().in_use, pool.books().free) == (3, 13)
        await pool.give_back(pages)  # the adopted pages are ordinary held pages now
        pool.check()
        assert pool.books().in_use == 0 and pool.n_ready_for(1000) == 3
        pool.worker.stop()

    asyncio.run(run())


def test_admission_one_function_for_every_limit():
    from kvcached_service.server.core.pool import Budget, admit

    books = [Budget("D0", 4096, 100), Budget("D1", 4096, 50)]
    admit(books, session="s", guaranteed_bytes=0, max_bytes=0, device="D0", held_pages=90, more_pages=10)
    with pytest.raises(errors.ResourceExhausted, match="exceed its maximum of 100 pages \\(the device budget\\)"):
        admit(books, session="s", guaranteed_bytes=0, max_bytes=0, device="D0", held_pages=90, more_pages=11)
    with pytest.raises(errors.ResourceExhausted, match="maximum of 8 pages \\(max_bytes 32 KiB\\)"):
        admit(books, session="s", guaranteed_bytes=0, max_bytes=8 * 4096, device="D0", held_pages=0, more_pages=9)
    # a guarantee applies on every device: the smallest budget decides
    admit(books, session="s", guaranteed_bytes=30 * 4096, max_bytes=0, others_guaranteed=20 * 4096)
    with pytest.raises(errors.ResourceExhausted, match="more than device D1's budget"):
        admit(books, session="s", guaranteed_bytes=31 * 4096, max_bytes=0, others_guaranteed=20 * 4096)
    with pytest.raises(errors.InvalidArgument, match="exceeds max_bytes"):
        admit(books, session="s", guaranteed_bytes=2, max_bytes=1, others_guaranteed=0)


def test_socket_variables_in_one_order(monkeypatch):
    """OLLAMA_KVCACHED_SOCKET wins over KVCACHED_SOCKET, as in the Go and C
    clients, the hook and kvcachedctl (docs/operations.md)."""
    from kvcached_service.client.client import socket_from_env

    monkeypatch.setenv("KVCACHED_SOCKET", "/generic.sock")
    monkeypatch.setenv("OLLAMA_KVCACHED_SOCKET", "/ollama.sock")
    assert socket_from_env() == "/ollama.sock"
    monkeypatch.delenv("OLLAMA_KVCACHED_SOCKET")
    assert socket_from_env() == "/generic.sock"
    monkeypatch.delenv("KVCACHED_SOCKET")
    with pytest.raises(errors.FailedPrecondition, match="no daemon socket given"):
        socket_from_env()


def test_sizes_parse_like_pydantic_bytesize():
    assert parse_size("2MiB") == 2 << 20 and parse_size("1.5GB") == 1_500_000_000 and parse_size(4096) == 4096
    for bad in ("lots", "-1", "2 parsecs"):
        with pytest.raises(ValueError, match="not a size"):
            parse_size(bad)


def test_budget_is_capped_by_what_the_device_has():
    """DevicePool.set_supply (issue 16): the budget is the configured limit
    capped at the pages the pool accounts for plus the device's free memory,
    never below what it accounts for; the rest of the limit is unavailable,
    not free; the books add up at every step; admission reads the new
    Budget; a Shortage names it."""

    async def run():
        pool = _pool(FakeBackend())  # 16 pages of 4 KiB
        s = _S(1, 1)
        assert pool.set_supply(100 * 4096) is None  # plenty: the limit holds
        assert pool.set_supply(6 * 4096) == (16, 6)  # an orphaned client maps 10 pages' worth
        b = pool.books()
        assert (b.budget_pages, b.free, b.unavailable, b.unavailable_bytes) == (6, 6, 10, 10 * 4096)
        assert pool.budget.pages == 6
        b.check()
        got = await pool.acquire(s, 4)
        with pytest.raises(errors.ResourceExhausted, match="budget 24 KiB"):
            await pool.acquire(s, 3)  # only 2 left
        # the device now has 1 page free besides the daemon's 4: budget 5, never below what is held
        assert pool.set_supply(1 * 4096) == (6, 5)
        assert pool.set_supply(0) == (5, 4)
        assert pool.books().free == 0 and pool.budget_pages == 4
        pool.check()
        await pool.give_back(got)
        # the orphan exits: everything back up to the configured limit
        assert pool.set_supply(12 * 4096) == (4, 16)
        b = pool.books()
        assert (b.budget_pages, b.unavailable, b.pooled + b.in_use + b.free) == (16, 0, 16)
        pool.worker.stop()

    asyncio.run(run())


def test_front_door_names_callers_and_fails_closed(tmp_path):
    """control.ControlFront.peer: a call through a live connection has its
    client's credentials; one whose connection is gone matches no uid (GONE);
    a direct connection to grpcio's private socket (only the daemon's uid
    and root can make one) is not named (None: trusted)."""
    from kvcached_service.config import Settings
    from kvcached_service.server.transports import control

    front = control.ControlFront(Settings(socket=str(tmp_path / "k.sock")))
    try:
        assert os.stat(os.path.dirname(front.private_path)).st_mode & 0o777 == 0o700
        front._conns["kvcached-0123abcd"] = control._Conn(1, "kvcached-0123abcd", control.Peer(42, 1000, 1000), 0.0)
        assert front.peer("unix-abstract:kvcached-0123abcd") == control.Peer(42, 1000, 1000)
        assert front.peer("unix-abstract:kvcached-ffffffff") is control.GONE and control.GONE.uid == -1
        assert front.peer("unix:") is None and front.peer("unix-abstract:other") is None
        assert control.first_call(b"PRI * HTTP/2.0\r\n") is None  # preface still arriving
        assert control.first_call(b"GET / HTTP/1.1\r\n\r\n") == -1  # not HTTP/2
        hdr = (0).to_bytes(3, "big") + bytes([0x4, 0]) + (0).to_bytes(4, "big")
        call = (5).to_bytes(3, "big") + bytes([0x1, 0x4]) + (3).to_bytes(4, "big") + b"xxxxx"
        assert control.first_call(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + hdr + call) == 3
    finally:
        front.close()
    assert not os.path.exists(os.path.dirname(front.private_path))


def test_front_door_relays_early_client_bytes_in_order_and_names_the_caller(tmp_path):
    """Bytes a client sends before grpcio's side is up (its HTTP/2 preface,
    then its SETTINGS right behind) reach grpcio first and in order: nobody
    reads the client's socket until relay.c has both sides, so nothing can
    overtake (the Python relay this replaced once wrote SETTINGS ahead of a
    kept preface: grpcio closed the connection, the client read EOF). The
    socket grpcio sees is named after the connection, and peer() of that
    name is the client's kernel credentials; when the client closes, the
    front door forgets it (GONE) and grpcio's side reads EOF."""
    from kvcached_service.config import Settings
    from kvcached_service.server.transports import control

    preface, settings = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"

    async def run():
        loop = asyncio.get_running_loop()
        front = control.ControlFront(Settings(socket=str(tmp_path / "k.sock")))
        grpc_side = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # stands in for grpcio
        grpc_side.bind(front.private_path)
        grpc_side.listen(8)
        grpc_side.setblocking(False)
        try:
            await front.start()
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            client.connect(front.path)
            client.sendall(preface)
            client.sendall(settings)
            await asyncio.sleep(0.1)  # the front door has accepted it and is connecting
            server, _ = await loop.sock_accept(grpc_side)
            client.sendall(b"call")
            server.setblocking(True)
            server.settimeout(5)
            got = b""
            while len(got) < len(preface + settings + b"call"):
                got += await asyncio.to_thread(server.recv, 65536)
            assert got == preface + settings + b"call"
            server.sendall(b"answer")
            client.settimeout(5)
            assert await asyncio.to_thread(client.recv, 100) == b"answer"

            name = server.getpeername()  # the abstract name the front door bound
            assert isinstance(name, bytes) and name.startswith(b"\0kvcached-")
            grpc_peer = "unix-abstract:" + name[1:].decode()
            assert front.peer(grpc_peer) == control.Peer(os.getpid(), os.getuid(), os.getgid())
            assert front.stats()["open"] == 1

            client.close()
            assert await asyncio.to_thread(server.recv, 100) == b""  # relay.c closed grpcio's side
            for _ in range(100):
                if front.stats()["open"] == 0:
                    break
                await asyncio.sleep(0.02)
            assert front.stats()["open"] == 0 and front.peer(grpc_peer) is control.GONE
            server.close()
        finally:
            front.close()
            grpc_side.close()

    asyncio.run(run())


def test_front_door_connects_through_a_full_backlog(tmp_path):
    """The relay's connect to grpcio's private socket waits while that
    socket's backlog is full, and then is really connected (asyncio's
    sock_connect takes a Unix socket's EAGAIN for a connect in progress and
    returns a socket that is not connected: a client's first call then
    read EOF); the control socket itself listens with a deep backlog, not
    asyncio's default of 100."""
    from kvcached_service.config import Settings
    from kvcached_service.server.transports import control

    path = str(tmp_path / "l.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(0)

    async def run():
        filler = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
        await control._unix_connect(filler, path)  # takes the one backlog slot
        late = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
        waiting = asyncio.ensure_future(control._unix_connect(late, path))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # still EAGAIN: waiting, not "connected"
        accepted, _ = listener.accept()  # a slot frees up
        await asyncio.wait_for(waiting, 5)
        late.send(b"x")  # connected for real (was ENOTCONN with sock_connect)
        full = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
        with pytest.raises(OSError, match="backlog stayed full"):
            await control._unix_connect(full, path, patience=0.05)
        for s in (filler, late, full, accepted):
            s.close()

        front = control.ControlFront(Settings(socket=str(tmp_path / "k.sock")))
        try:
            await front.start()
            clients = []
            for _ in range(300):  # no accept in between: the loop does not run
                c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
                clients.append(c)
                c.connect(front.path)  # BlockingIOError past a backlog of 100
            for c in clients:
                c.close()
        finally:
            front.close()

    try:
        asyncio.run(run())
    finally:
        listener.close()


def test_pool_allocate_waits_for_pages_being_zeroed():
    """An Allocate short only by pages still being zeroed gets them once they
    are zeroed, instead of RESOURCE_EXHAUSTED (a slow device's memset: seen on
    the strict test driver, where zeroing lands at synchronize)."""
    import threading

    class SlowZero(FakeBackend):
        def __init__(self):
            super().__init__()
            self.gate = threading.Event()

        def needs_zeroing(self, pages):
            return list(pages)

        def zero_pages(self, device, pages):
            self.gate.wait(10)

    async def run():
        be = SlowZero()
        pool = _pool(be, budget_pages=16)
        s = _S(1, 1)
        first = await pool.acquire(s, 16)
        back = asyncio.ensure_future(pool.give_back(first))
        await asyncio.sleep(0.05)
        assert pool.books().pooled == 16 and pool.n_ready_total() == 0  # every page being zeroed
        got = asyncio.ensure_future(pool.acquire(s, 16))
        await asyncio.sleep(0.3)
        assert not got.done()  # waiting for them, not refused
        be.gate.set()
        await back
        pages = await asyncio.wait_for(got, 5)
        assert len(pages) == 16 and pool.counters.created_total == 16  # the zeroed pages, none new
        pool.check()
        pool.worker.stop()

    asyncio.run(run())


# ---- backends and mappers are tables (issue 26 item 5) ---------------------------
def test_a_registered_backend_is_chosen_without_editing_dispatch_code(monkeypatch, caplog):
    """One register() line makes a backend: --backend validates against the
    table, open_backend builds it, and auto tries it in registration order
    before falling back to host with the log line users know."""
    import logging

    from kvcached_service import backends

    monkeypatch.setattr(backends, "_REGISTRY", dict(backends._REGISTRY))  # undone after the test
    made = []

    def fake_factory(settings):
        made.append(settings.backend)
        return FakeBackend()

    backends.register("fake", fake_factory, summary="fake pages", what="fake runtime", auto=True)
    assert backends.choices() == ["auto", "host", "cuda", "fake"]
    assert load_settings({"backend": "fake"}).backend == "fake"
    with pytest.raises(ConfigError, match=r"backend \(--backend, KVCACHED_BACKEND\): Input should be 'auto', 'host', 'cuda' or 'fake'"):
        load_settings({"backend": "hip"})

    caplog.set_level(logging.INFO, logger="kvcached")
    b = backends.open_backend("fake", load_settings({"backend": "fake"}))
    assert isinstance(b, FakeBackend) and made == ["fake"]
    assert "backend: fake (fake pages), 1 device(s)" in caplog.text

    def no_cuda(settings):
        raise errors.FailedPrecondition("no libcuda here")

    backends.register("cuda", no_cuda, summary="driver VMM API", what="CUDA driver", auto=True)
    b = backends.open_backend("auto", load_settings({}))
    assert isinstance(b, FakeBackend) and made == ["fake", "auto"]  # cuda passed over, fake taken

    def broken(settings):
        raise RuntimeError("no device")

    backends.register("fake", broken, summary="fake pages", what="fake runtime", auto=True)
    caplog.clear()
    b = backends.open_backend("auto", load_settings({"host_memory": "1GiB"}))
    assert isinstance(b, HostBackend) and b.devices()[0].total_bytes == 1 << 30
    assert ("backend: host (memfd pages): no usable CUDA driver (no libcuda here); "
            "no usable fake runtime (RuntimeError: no device); serving host memory instead of GPU memory") in caplog.text
    with pytest.raises(backends.BackendUnusable, match=r"^--backend fake: the fake runtime is not usable: RuntimeError: no device$"):
        backends.open_backend("fake", load_settings({"backend": "fake"}))


def test_the_real_backend_table():
    from kvcached_service import backends

    assert backends.choices() == ["auto", "host", "cuda"]
    assert [e.name for e in backends.auto_order()] == ["cuda"] and backends.fallback_entry().name == "host"
    assert backends.auto_help() == "page backend; auto = cuda if usable, else host"
    with pytest.raises(ConfigError, match=r"Input should be 'auto', 'host' or 'cuda'"):
        load_settings({"backend": "gpu"})


def test_a_registered_mapper_is_chosen_without_editing_dispatch_code(monkeypatch):
    """One register_mapper() line makes a device kind mappable: mapper_for
    and Session.mapper (the client's one place) use the table; a kind
    nobody registered is a clear FailedPrecondition."""
    import threading
    from types import SimpleNamespace

    from kvcached_service.client import mapping
    from kvcached_service.client.client import Session

    monkeypatch.setattr(mapping, "_MAPPERS", dict(mapping._MAPPERS))

    class FakeMapper(mapping.HostMapper):
        kind = "fake"

        def __init__(self, device_uuid):
            self.device_uuid = device_uuid

    mapping.register_mapper("fake", FakeMapper)
    assert mapping.mapper_kinds() == ["host", "cuda", "fake"]
    m = mapping.mapper_for("fake", "FAKE-0")
    assert isinstance(m, FakeMapper) and m.device_uuid == "FAKE-0" and m.view_device() == "cpu"

    dev = SimpleNamespace(kind="fake")
    s = SimpleNamespace(_lock=threading.Lock(), _mappers={}, client=SimpleNamespace(device=lambda uuid: dev, info=SimpleNamespace(fd_channel_keep_handles=False)))
    got = Session.mapper(s, "FAKE-0")
    assert isinstance(got, FakeMapper) and Session.mapper(s, "FAKE-0") is got  # one per device

    dev.kind = "hip"
    with pytest.raises(errors.FailedPrecondition, match=r"device FAKE-1 has kind 'hip', which this client cannot map"):
        Session.mapper(s, "FAKE-1")
    assert isinstance(mapping.mapper_for("host", "HOST-0"), mapping.HostMapper)
    assert mapping.Mapper.view_device(m) is None  # a mapper that says nothing gets no views


def test_pool_waits_for_zeroing_only_when_those_pages_cover_the_request():
    """A Free is answered before its pages are zeroed (the pool's zeroer, in
    the background). An Allocate of the same uid that those pages cover
    waits for them instead of creating new ones (counted in the books); one
    they cannot cover is not held up by them: a request the budget cannot
    cover fails at once."""
    import time as _time

    class SlowZero(FakeBackend):
        def zero_pages(self, device, pages):
            _time.sleep(0.5)

    async def run():
        be = SlowZero()
        pool = _pool(be, budget_pages=8)
        s = _S(1, 1000)
        first = await pool.acquire(s, 4)
        pool.give_back_now(first)  # dirty (FakeBackend: every page needs zeroing): to the zeroer
        assert pool.books().zeroing == 4 and pool.n_ready_for(1000) == 0
        pool.check()
        t0 = _time.monotonic()
        with pytest.raises(errors.ResourceExhausted, match="cannot allocate 9 pages"):
            await pool.acquire(s, 9)  # more than the budget: not held up by the zeroing
        assert _time.monotonic() - t0 < 0.3
        created = pool.counters.created_total
        again = await pool.acquire(s, 3)  # covered by the 4 being zeroed: waits for them
        assert pool.counters.created_total == created and {p.id for p in again} <= {p.id for p in first}
        b = pool.books()
        assert b.zero_waits_total == 1 and b.zero_wait_seconds_total > 0.2 and b.zeroed_total == 4
        pool.check()
        pool.worker.stop()

    asyncio.run(run())


def test_ready_pages_take_if_takes_all_or_nothing():
    from kvcached_service.server.core.pool.pages import Page, ReadyPages

    r = ReadyPages()
    for i, uid in enumerate((None, None, 7)):
        r.put(Page(id=i + 1, device="D", handle=None, uid=uid))  # type: ignore[arg-type]
    assert r.n == len(r) == 3
    assert r.take_if(8, 3) is None and r.n == 3  # uid 8 may take the 2 fresh pages only: nothing taken
    got = r.take_if(7, 3)
    assert got is not None and [p.id for p in got] == [3, 2, 1]  # its own first, then fresh
    assert r.n == 0 and r.take_if(7, 1) is None
    assert r.take_with_foreign(7, 0, 0) == ([], [])


def test_page_ids_take_a_batch_in_order():
    from kvcached_service.server.core.pool import PageIds

    ids = PageIds(5)
    assert list(ids.take(3)) == [5, 6, 7] and ids.next() == 8 and list(ids.take(0)) == [] and ids.peek() == 9


def test_the_warm_pool_refills_below_half_its_target_and_then_to_the_whole():
    """An Allocate that leaves half the warm target or more ready starts no
    refill (no page made on the worker for a pool still warm); one that
    leaves less refills it to the whole target."""
    async def run():
        be = FakeBackend()
        pool = _pool(be, warm=4)
        await pool.prefill()
        made = pool.books().created_total
        s = _S(1, 1)
        held = await pool.acquire(s, 2)  # 2 of 4 left ready: half, no refill
        await asyncio.sleep(0.05)
        assert pool.n_ready_total() == 2 and pool.books().created_total == made
        held += await pool.acquire(s, 1)  # 1 of 4 left: below half
        for _ in range(100):
            if pool.n_ready_total() == 4:
                break
            await asyncio.sleep(0.01)
        assert pool.n_ready_total() == 4 and pool.books().created_total == made + 3
        await pool.give_back(held)
        pool.check()
        pool.worker.stop()

    asyncio.run(run())
