"""Kept handles (docs/protocol.md, "Kept handles"; issue 42 item 3).

A client that frees pages with FREE's keep flag keeps their imported
handles; the daemon records it as their keeper and releases such a page only
after the keeper answered DROP with DROPPED (or its session ended; a silent
keeper loses its session). The daemon's side is tested with raw fd channels
on the host backend (the daemon does not care what a client keeps); the
Python client's cache on the CUDA test driver: a page that comes back is
mapped from its kept handle (no import), a DROP releases it, and so does the
daemon going away.
"""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from kvtest import assert_books, wait_until
from kvcached_service import errors, fdchannel
from kvcached_service.server.core.pool.keepers import Keepers
from kvcached_service.server.core.pool.pages import Page
from kvcached_service.backends.base import PageHandle


def _channel(d, c, name="keeper"):
    """A raw fd channel with a session bound to it."""
    from helpers.raw import stub
    from kvcached_service._generated.kvcached.v1 import kvcached_pb2 as pb

    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(d.fd_socket)
    s.settimeout(5)
    hello = fdchannel.recv_record(s)
    ref = stub(d).OpenSession(pb.OpenSessionRequest(channel_secret=hello.secret, name=name), timeout=10).session
    return s, ref


def _allocate(s, req: int, n: int) -> list[int]:
    fdchannel.send_record(s, fdchannel.encode_allocate(req, n))
    ids: list[int] = []
    while True:
        rec = fdchannel.recv_record(s)
        if isinstance(rec, fdchannel.Pages):
            ids += rec.page_ids
            fdchannel.close_fds(rec.fds)
            continue
        assert isinstance(rec, fdchannel.Reply) and rec.req_id == req and rec.code == 0, rec
        return ids


def _call(s, data: bytes, req: int) -> fdchannel.Reply:
    fdchannel.send_record(s, data)
    rec = fdchannel.recv_record(s)
    assert isinstance(rec, fdchannel.Reply) and rec.req_id == req, rec
    return rec


def _pooled(c) -> int:
    return c.stats().total.pages_pooled


# ---- the daemon, with raw channels on the host backend ------------------------------
def test_getinfo_offers_kept_handles(host_daemon):
    with host_daemon.client() as c:
        assert c.info.fd_channel_keep_handles


def test_a_kept_page_is_released_only_after_its_keeper_dropped_it(daemon_factory):
    from test_metrics import scrape, value

    d = daemon_factory("host", pool_idle_seconds=0, metrics_address="127.0.0.1:0")
    with d.client() as c:
        s, _ = _channel(d, c)
        ids = _allocate(s, 1, 3)
        assert _call(s, fdchannel.encode_free(2, ids, keep=True), 2).value == 3
        s.settimeout(5)
        drop = fdchannel.recv_record(s)  # the idle trim wants them: it asks first
        assert isinstance(drop, fdchannel.Drop) and sorted(drop.page_ids) == sorted(ids), drop
        st = c.stats()
        assert st.total.pages_pooled == 3, "released before the keeper dropped its handles"
        assert_books(st)
        text = scrape(d)
        dev = st.devices and next(iter(st.devices))
        assert value(text, "kvcached_device_kept_bytes", device=dev) == 3 * c.device().page_size
        assert value(text, "kvcached_device_drops_total", device=dev) == 3
        assert _call(s, fdchannel.encode_dropped(3, list(drop.page_ids)), 3).value == 3
        assert wait_until(lambda: _pooled(c) == 0), "not released after DROPPED"
        assert value(scrape(d), "kvcached_device_kept_bytes", device=dev) == 0
        assert _call(s, fdchannel.encode_dropped(4, ids), 4).value == 0  # kept no more: no error
        assert_books(c.stats())
        s.close()


def test_pages_freed_without_keep_are_released_without_asking(daemon_factory):
    d = daemon_factory("host", pool_idle_seconds=0)
    with d.client() as c:
        s, _ = _channel(d, c)
        ids = _allocate(s, 1, 2)
        assert _call(s, fdchannel.encode_free(2, ids), 2).value == 2
        assert wait_until(lambda: _pooled(c) == 0)
        s.settimeout(0.3)
        with pytest.raises(socket.timeout):
            fdchannel.recv_record(s)  # no DROP came
        s.close()


def test_a_silent_keeper_loses_its_session_and_the_page_is_released(daemon_factory):
    from test_metrics import scrape, value

    d = daemon_factory("host", pool_idle_seconds=0, fd_send_timeout=1, metrics_address="127.0.0.1:0")
    with d.client() as c:
        s, ref = _channel(d, c)
        ids = _allocate(s, 1, 2)
        other = _allocate(s, 2, 1)  # held: goes back when the session ends
        assert _call(s, fdchannel.encode_free(3, ids, keep=True), 3).value == 2
        assert isinstance(fdchannel.recv_record(s), fdchannel.Drop)
        err = fdchannel.recv_record(s)  # not answered: after fd_send_timeout, the session ends
        assert isinstance(err, fdchannel.Error) and err.code == errors.Code.UNAVAILABLE, err
        assert "did not answer DROP of 2 pages within 1 s" in err.message, err.message
        assert fdchannel.recv_record(s) is None
        assert wait_until(lambda: c.stats().total.pages_in_use == 0 and _pooled(c) == 0), c.stats().total
        assert other and all(x.id != ref.id for x in c.stats().sessions)
        assert_books(c.stats())
        assert value(scrape(d), "kvcached_device_drop_silent_total", device=next(iter(c.stats().devices))) == 1
        s.close()


def test_a_keepers_end_releases_its_pages_without_a_drop(daemon_factory):
    d = daemon_factory("host", pool_idle_seconds=1)
    with d.client() as c:
        s, _ = _channel(d, c)
        ids = _allocate(s, 1, 2)
        assert _call(s, fdchannel.encode_free(2, ids, keep=True), 2).value == 2
        s.close()  # the session ends before the trim: its keeps end with it
        assert wait_until(lambda: _pooled(c) == 0, timeout=5)
        assert_books(c.stats())


def test_dropped_is_checked_like_free(host_daemon):
    with host_daemon.client() as c:
        s, _ = _channel(host_daemon, c)
        rep = _call(s, fdchannel._frame(fdchannel.REQ_DROPPED, fdchannel._REQ_FREE.pack(5, 0, 0)), 5)
        assert rep.code == errors.Code.INVALID_ARGUMENT and "empty" in rep.message
        assert _call(s, fdchannel.encode_dropped(6, [123456]), 6).value == 0  # never kept: no error
        s.close()


# ---- the pool's part, alone ---------------------------------------------------------
class _S:
    def __init__(self, sid: int):
        self.id = sid


def _page(pid: int) -> Page:
    return Page(id=pid, device="D", handle=PageHandle(fd=-1, size=4096))


def test_keepers_wait_for_every_keeper_then_for_nobody():
    async def main():
        asked: list[tuple[int, list[int]]] = []
        k = Keepers("D", ask=lambda s, ids: asked.append((s.id, sorted(ids))), timeout=5)
        a, b = _S(1), _S(2)
        p1, p2, p3 = _page(1), _page(2), _page(3)
        k.keep(a, [p1, p2])
        k.keep(b, [p2])
        assert len(k) == 2 and k.keeps(a) == 2
        task = asyncio.ensure_future(k.release_ready([p1, p2, p3]))
        await asyncio.sleep(0.05)
        assert sorted(asked) == [(1, [1, 2]), (2, [2])] and not task.done()
        assert k.dropped(a, [1, 2, 99]) == 2
        await asyncio.sleep(0.05)
        assert not task.done()  # b still keeps page 2
        k.forget(b)  # its session ended
        await asyncio.wait_for(task, 1)
        assert len(k) == 0 and k.counters.dropped_total == 2 and k.counters.drops_total == 3
        await k.release_ready([p1, p2, p3])  # nobody keeps them: at once, nobody asked
        assert len(asked) == 2

    asyncio.run(main())


def test_keepers_end_a_silent_keeper():
    async def main():
        silent: list[tuple[int, int]] = []
        k = Keepers("D", ask=lambda s, ids: None, silent=lambda s, n: silent.append((s.id, n)), timeout=0.2)
        a = _S(7)
        p = _page(1)
        k.keep(a, [p])
        await asyncio.wait_for(k.release_ready([p]), 2)
        assert silent == [(7, 1)] and not p.keepers and k.counters.silent_total == 1

    asyncio.run(main())


# ---- the Python client on the CUDA test driver ------------------------------------------
def _cuda(daemon_factory, **settings):
    return daemon_factory("cuda", memory_limit="64MiB", page_size="2MiB", **settings)


@pytest.mark.cuda
def test_a_returning_page_is_mapped_from_its_kept_handle(daemon_factory):
    d = _cuda(daemon_factory)
    with d.client() as c, c.open_session("kept") as s:
        assert c.info.fd_channel_keep_handles
        r = s.region(8 << 20)
        r.map(0, 8 << 20)
        m = s.mapper(r.device.uuid)
        assert m.kept == 4 and m.kept_hits == 0
        r.write(0, b"first loan")
        first = r.page_ids()
        r.unmap(0, 8 << 20)  # FREE with keep
        r.map(0, 8 << 20)
        assert sorted(r.page_ids()) == sorted(first)  # the same pages came back (one uid, last in first out)
        assert m.kept_hits == 4 and m.kept == 4  # mapped from the kept handles: no import
        assert r.read(0, 10) == bytes(10)  # zeroed all the same
        r.write(0, b"second loan")
        assert r.read(0, 11) == b"second loan"
        r.close()
        assert_books(c.stats())


@pytest.mark.cuda
def test_no_kept_handles_when_the_limit_is_zero(daemon_factory, monkeypatch):
    monkeypatch.setenv("KVCACHED_KEEP_HANDLES", "0")
    d = _cuda(daemon_factory)
    with d.client() as c, c.open_session("unkept") as s:
        r = s.region(4 << 20)
        r.map(0, 4 << 20)
        r.unmap(0, 4 << 20)
        r.map(0, 4 << 20)
        m = s.mapper(r.device.uuid)
        assert (m.kept, m.kept_hits) == (0, 0)
        r.close()


@pytest.mark.cuda
def test_a_drop_releases_the_kept_handles_and_then_the_pages(daemon_factory):
    d = _cuda(daemon_factory, pool_idle_seconds=0)
    with d.client() as c, c.open_session("dropped") as s:
        r = s.region(6 << 20)
        r.map(0, 6 << 20)
        m = s.mapper(r.device.uuid)
        r.unmap(0, 6 << 20)  # kept; the idle trim asks for them, the reader answers
        assert wait_until(lambda: m.kept == 0, timeout=5), "the DROP was not answered"
        assert wait_until(lambda: _pooled(c) == 0, timeout=5), "the pages were not released after DROPPED"
        r.map(0, 2 << 20)  # a new page: imported (and kept) again
        assert m.kept == 1 and m.kept_hits == 0
        r.close()
        assert_books(c.stats())


@pytest.mark.cuda
def test_kept_handles_go_when_the_daemon_goes(daemon_factory):
    d = _cuda(daemon_factory)
    c = d.client()
    s = c.open_session("goes")
    r = s.region(4 << 20)
    r.map(0, 4 << 20)
    m = s.mapper(r.device.uuid)
    r.unmap(0, 4 << 20)
    assert m.kept == 2
    d.proc.kill()
    d.proc.wait(10)
    assert wait_until(lambda: m.kept == 0, timeout=5), "kept handles outlived the daemon that recorded them"
    s.close()  # ended already: closing is quiet
    c.close()


@pytest.mark.cuda
def test_kept_handles_are_let_go_across_a_resume_and_kept_again_after(daemon_factory, tmp_path):
    """The handle cache is invalidated when the daemon restarts: a resumed
    session keeps nothing of the old daemon's (its page ids promise nothing
    now), its mapped pages stay usable, and it keeps handles again after."""
    state = str(tmp_path / "state")
    d = _cuda(daemon_factory, state_dir=state)
    c = d.client()
    s = c.open_session("resumer")
    r = s.region(8 << 20)
    r.map(0, 8 << 20)
    r.write(0, b"mapped across")
    r.unmap(4 << 20, 4 << 20)  # 2 pages freed with keep, 2 held
    m = s.mapper(r.device.uuid)
    assert m.kept == 4
    d.sigkill()
    assert wait_until(lambda: m.kept == 0, timeout=5), "kept handles outlived the daemon that recorded them"
    d2 = _cuda(daemon_factory, state_dir=state, socket=d.socket)
    assert s.wait_resumed(20), d2.log_text()  # the test driver's exported fds identify their pages
    assert r.read(0, 13) == b"mapped across"
    hits = m.kept_hits
    r.map(4 << 20, 4 << 20)  # the restarted daemon's pages: imported (no stale handle used), kept again
    assert m.kept_hits == hits and m.kept == 2
    r.unmap(4 << 20, 4 << 20)
    r.map(4 << 20, 4 << 20)
    assert m.kept_hits == hits + 2  # and mapped from them when they come back
    r.close()
    assert_books(c.stats())
    s.close()
    c.close()
