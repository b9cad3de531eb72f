"""Standby pages (docs/protocol.md, "Standby pages"; issue 42 item 4).

A client may keep pages it no longer uses mapped as standby: a FREE with
the standby flag leaves them the session's (in use in the daemon's books,
counted as standby separately), mapping the range again takes them back
with no Allocate and no driver call (a USE record, not waited for), and a
reclaim asks sessions with standby pages first, which give those first.
"""

from __future__ import annotations

import threading

import pytest

from kvtest import assert_books, wait_until
from kvcached_service import errors, fdchannel

MiB = 1 << 20


def _session_stats(s):
    return next(x for x in s.stats().sessions if x.id == s.id)


def test_a_region_regrows_from_standby_without_an_allocate(daemon_factory, backend):
    d = daemon_factory(backend, memory_limit="64MiB", page_size="2MiB")
    with d.client() as c, c.open_session("standby") as s:
        assert c.info.fd_channel_standby
        r = s.region(16 * MiB)
        r.map(0, 8 * MiB)
        r.write(4 * MiB, b"still here")
        ids = r.page_ids()
        assert r.trim_to(2 * MiB, standby=True) == 3
        assert (r.mapped_pages, r.standby_pages) == (1, 3)
        assert not r.is_mapped(4 * MiB)
        with pytest.raises(errors.FailedPrecondition):
            r.read(4 * MiB, 10)  # given up by the caller: not readable through the region
        st = c.stats()
        me = _session_stats(s)
        assert me.pages_held == 4 and me.standby_bytes == 6 * MiB
        assert st.total.standby_bytes == 6 * MiB and st.total.pages_in_use == 4
        assert_books(st)
        allocs = me.allocations_total
        assert r.map(0, 8 * MiB) == 3  # back from standby: no Allocate
        assert r.page_ids() == ids and r.standby_pages == 0
        assert r.read(4 * MiB, 10) == b"still here"  # never left this process: not zeroed
        assert wait_until(lambda: _session_stats(s).standby_bytes == 0)  # the USE reached the daemon's books
        assert _session_stats(s).allocations_total == allocs
        assert c.stats().total.standby_bytes == 0
        r.trim_to(0, standby=True)
        r.close()  # standby pages go back with the rest
        st = c.stats()
        assert st.total.pages_in_use == 0 and st.total.standby_bytes == 0
        assert_books(st)


def test_standby_pages_are_freed_like_held_ones(daemon_factory):
    d = daemon_factory("host", memory_limit="64MiB", page_size="2MiB")
    with d.client() as c, c.open_session("standby-free") as s:
        r = s.region(8 * MiB)
        r.map(0, 8 * MiB)
        r.unmap(4 * MiB, 4 * MiB, standby=True)
        assert _session_stats(s).standby_bytes == 4 * MiB
        assert r.unmap(4 * MiB, 4 * MiB) == 2  # a plain unmap of standby pages gives them back
        me = _session_stats(s)
        assert me.standby_bytes == 0 and me.pages_held == 2
        assert_books(c.stats())
        r.close()


def test_a_reclaim_asks_the_session_with_standby_pages_and_it_gives_those(daemon_factory):
    d = daemon_factory("host", memory_limit="32MiB", page_size="2MiB", reclaim_timeout_ms="3000")
    with d.client() as c:
        busy = c.open_session("busy")  # lower priority, all in use: would be asked first without standby
        idle = c.open_session("idle")
        rb, ri = busy.region(16 * MiB), idle.region(16 * MiB)
        rb.map(0, 8 * MiB)
        ri.map(0, 8 * MiB)
        ri.write(0, b"in use")
        ri.trim_to(2 * MiB, standby=True)  # 3 pages standby, 1 in use
        asked = {"busy": 0, "idle": 0}

        def answer(name, region):
            def on(ev):
                asked[name] += 1
                region.release_pages(ev.pages)
            return on

        busy.on_reclaim(answer("busy", rb))
        idle.on_reclaim(answer("idle", ri))
        s3 = c.open_session("newcomer")
        r3 = s3.region(32 * MiB)
        r3.map(0, 22 * MiB, wait=True, wait_timeout_ms=5000)  # 11 pages: 8 free, 3 must come back
        assert asked == {"busy": 0, "idle": 1}, asked
        assert (ri.standby_pages, ri.mapped_pages) == (0, 1)  # it gave its standby pages, kept what it uses
        assert ri.read(0, 6) == b"in use" and rb.mapped_pages == 4
        assert_books(c.stats())
        for s, r in ((busy, rb), (idle, ri), (s3, r3)):
            r.close()
            s.close()


def test_use_and_standby_records_are_checked(host_daemon):
    from test_kept_handles import _allocate, _call, _channel

    with host_daemon.client() as c:
        s, _ = _channel(host_daemon, c)
        ids = _allocate(s, 1, 2)
        rep = _call(s, fdchannel.encode_free(2, [ids[0], 999], standby=True), 2)
        assert rep.code == errors.Code.NOT_FOUND  # all or nothing, as a Free
        assert _call(s, fdchannel.encode_free(3, ids, standby=True), 3).value == 2
        assert _call(s, fdchannel.encode_use(4, [ids[0], 12345]), 4).value == 1  # not held: no error
        assert _call(s, fdchannel.encode_use(5, [ids[0]]), 5).value == 0  # in use already
        rep = _call(s, fdchannel._frame(fdchannel.REQ_USE, fdchannel._REQ_FREE.pack(6, 0, 0)), 6)
        assert rep.code == errors.Code.INVALID_ARGUMENT
        assert _call(s, fdchannel.encode_free(7, ids), 7).value == 2  # standby or not, a Free gives them back
        st = c.stats()
        assert st.total.standby_bytes == 0 and st.total.pages_in_use == 0
        assert_books(st)
        s.close()


def test_standby_is_said_again_to_a_restarted_daemon(daemon_factory, backend, tmp_path):
    """The daemon does not journal standby: a resumed session says again
    which of its adopted pages it keeps as standby, so a reclaim still asks
    for those first; a page taken back while the daemon was away is not."""
    state = str(tmp_path / "state")
    d = daemon_factory(backend, memory_limit="64MiB", page_size="2MiB", state_dir=state)
    c = d.client()
    s = c.open_session("standby-resume")
    r = s.region(16 * MiB)
    r.map(0, 8 * MiB)
    r.write(0, b"kept across")
    assert r.trim_to(2 * MiB, standby=True) == 3
    assert _session_stats(s).standby_bytes == 6 * MiB
    d.sigkill()
    d2 = daemon_factory(backend, memory_limit="64MiB", page_size="2MiB", state_dir=state, socket=d.socket)
    assert s.wait_resumed(20), d2.log_text()
    assert wait_until(lambda: _session_stats(s).standby_bytes == 6 * MiB, timeout=5), _session_stats(s)
    me = _session_stats(s)
    assert me.pages_held == 4
    assert r.read(0, 11) == b"kept across"
    assert r.map(0, 4 * MiB) == 1  # one page back from standby: the restarted daemon's books follow
    assert wait_until(lambda: _session_stats(s).standby_bytes == 4 * MiB, timeout=5)
    assert_books(c.stats())
    r.close()
    s.close()
    c.close()
