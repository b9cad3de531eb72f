"""The page store in systemd's own fd store (issue 25, server/recovery/keeper.py
SystemdStore): under a unit with FileDescriptorStoreMax= the daemon keeps its
own fd of every lent page in systemd (sd_notify FDSTORE=1, FDNAME=~ID in base 64,
FDPOLL=0; FDSTOREREMOVE=1 when the page goes back) and gets them back at its
next start as LISTEN_FDS/LISTEN_FDNAMES. systemd ends the unit's whole cgroup
when the daemon dies, so a keeper process cannot outlive it there; systemd's
store does.

No systemd runs here: FakeSystemd plays its side of the real protocol (a
datagram NOTIFY_SOCKET receiving the messages and their fds over SCM_RIGHTS,
a store with FileDescriptorStoreMax's limit, and a start that passes the
stored fds from fd 3 on with LISTEN_PID/LISTEN_FDS/LISTEN_FDNAMES through
tests/listen_fds_exec.py; both in tests/systemdtest.py)."""

from __future__ import annotations

import os
import time

import pytest

from kvtest import Survivor, assert_books, wait_until
from systemdtest import FakeSystemd

MiB = 1 << 20


@pytest.fixture
def systemd(tmp_path):
    made: list[FakeSystemd] = []

    def make(capacity: int = 4096) -> FakeSystemd:
        made.append(FakeSystemd(tmp_path, capacity))
        return made[-1]

    yield make
    for f in made:
        f.close()


def page_names(ids) -> set[str]:
    from kvcached_service.server.recovery.keeper import fdname

    return {fdname(i) for i in ids}


@pytest.mark.parametrize("backend", ["host", "cuda"])
def test_sigkilled_unit_resumes_every_page_from_systemds_store(daemon_factory, systemd, tmp_path, backend):
    """The daemon as a unit with an fd store (--page-store auto picks it; no
    keeper is started): every lent page is in systemd's store under its id
    before the client holds it, and leaves it when freed. SIGKILL; the next
    start gets the store's fds: the session resumes with every page and its
    bytes (the CUDA test driver in its default identity, chardev: every
    export one device node's inode, as NVIDIA's driver; no client fd is
    compared). A clean stop empties the store."""
    sd = systemd()
    state = tmp_path / "state"
    d = daemon_factory(backend, env=sd.env(), state_dir=str(state), resume_grace="20")
    assert "page store: systemd's fd store (FileDescriptorStoreMax=4096) for a budget of 128 pages" in d.log_text()
    c = d.client()
    sv = Survivor(c)
    s, r = sv.s, sv.r
    held = sv.page_ids()
    assert wait_until(lambda: sd.names() == page_names(held), timeout=5), (sd.names(), held)
    assert sd.no_poll >= 13, "every page must be stored with FDPOLL=0"
    assert not (state / "keeper.sock").exists(), "a keeper was started under a unit with a store"
    d.sigkill()

    d2 = daemon_factory(backend, env=sd.env(), state_dir=str(state), resume_grace="20", socket=d.socket,
                        **sd.start_args())
    assert s.wait_resumed(20), d2.log_text()
    log = d2.log_text()
    assert "page store: 12 of the 12 pages of the previous daemon's sessions are in the store" in log, log
    assert s.my_stats().pages_held == 12
    assert sv.page_ids() == held
    sv.assert_intact()
    r.map(20 * MiB, 4 * MiB)  # it goes on: new pages join the store
    assert wait_until(lambda: sd.names() == page_names(sv.page_ids()), timeout=5)
    s.free(sv.loose)
    r.close()
    assert wait_until(lambda: sd.names() == set(), timeout=5), sd.names()
    st = c.stats()
    assert st.total.pages_in_use == 0
    assert_books(st)
    s.close()
    c.close()
    assert d2.stop() == 0
    assert sd.names() == set()


def test_a_store_too_small_for_prealloc_refuses_to_start(daemon_factory, systemd, tmp_path):
    """FileDescriptorStoreMax= below the pages --prealloc makes ready to lend:
    a setting to fix, exit 2 (not retried by the unit), naming both."""
    sd = systemd(capacity=4)
    d = daemon_factory("host", env=sd.env(), state_dir=str(tmp_path / "state"), prealloc="16MiB", wait=False)
    assert d.proc.wait(30) == 2
    log = d.log_text()
    assert "systemd's fd store holds 4 fds (FileDescriptorStoreMax=) but --prealloc makes 8 pages" in log, log
    assert "raise FileDescriptorStoreMax= to the budget's 128 pages" in log, log


def test_a_full_store_keeps_what_fits_and_says_so(daemon_factory, systemd, tmp_path):
    """A store smaller than the budget: the start names what the budget needs;
    pages lent past the store's size are not kept (said once); after a
    SIGKILL the pages in the store resume from it and the rest by the fds the
    client re-sends (host backend: memfds identify their pages)."""
    sd = systemd(capacity=5)
    state = tmp_path / "state"
    d = daemon_factory("host", env=sd.env(), state_dir=str(state), resume_grace="20")
    assert "pages lent beyond 5 are not kept" in d.log_text()
    c = d.client()
    s = c.open_session("big")
    r = s.region(16 * MiB)
    r.map(0, 16 * MiB)  # 8 pages
    r.write(15 * MiB, b"last page")
    assert wait_until(lambda: len(sd.names()) == 5, timeout=5)
    assert d.log_text().count("systemd's fd store is full (FileDescriptorStoreMax=5)") == 1
    d.sigkill()
    d2 = daemon_factory("host", env=sd.env(), state_dir=str(state), resume_grace="20", socket=d.socket,
                        **sd.start_args())
    assert s.wait_resumed(20), d2.log_text()
    assert "page store: 5 of the 8 pages of the previous daemon's sessions are in the store; 3 are not" in d2.log_text()
    assert s.my_stats().pages_held == 8
    assert r.read(15 * MiB, 9) == b"last page"
    r.close()
    s.close()
    c.close()


def test_listen_fds_are_this_process_and_named():
    """sd_listen_fds(3)'s rules: only for LISTEN_PID, names in order, the
    variables removed so no child takes them."""
    from kvcached_service.server.recovery.keeper import SystemdStore, fdname, listen_fds, page_of

    r, w = os.pipe()
    try:
        env = {"LISTEN_PID": "1", "LISTEN_FDS": "1", "LISTEN_FDNAMES": "~1"}
        assert listen_fds(env, pid=2) == []
        env = {"LISTEN_PID": "7", "LISTEN_FDS": "2", "LISTEN_FDNAMES": "~9:other"}
        got = listen_fds(env, pid=7)
        assert [n for n, _ in got] == ["~9", "other"] and [fd for _, fd in got] == [3, 4]
        assert env == {}
        # short names: one environment string holds them all at the next start
        assert [fdname(i) for i in (0, 63, 64, 262143, 262144)] == ["~0", "~_", "~10", "~___", "~1000"]
        assert all(page_of(fdname(i)) == i for i in range(0, 300000, 997))
        assert page_of("stored") is None and page_of("~") is None and page_of("~a:b") is None
        assert SystemdStore.wanted({"NOTIFY_SOCKET": "/run/x", "FDSTORE": "64"})
        assert not SystemdStore.wanted({"NOTIFY_SOCKET": "/run/x"})  # no store configured (or systemd < 254)
        assert not SystemdStore.wanted({"NOTIFY_SOCKET": "/run/x", "FDSTORE": "0"})
        assert not SystemdStore.wanted({"FDSTORE": "64"})
    finally:
        os.close(r)
        os.close(w)


def test_resume_of_1k_pages_from_systemds_store(daemon_factory, systemd, tmp_path):
    """How long a resume of 1,000 pages takes with the pages in systemd's
    store (4 KiB host pages; printed, not asserted: docs/reliability.md)."""
    sd = systemd(capacity=20000)
    state = tmp_path / "state"
    kw = dict(env=sd.env(), state_dir=str(state), resume_grace="30", page_size="4096", memory_limit="64MiB",
              max_pages_per_request="2048")
    d = daemon_factory("host", **kw)
    c = d.client()
    s = c.open_session("thousand")
    pages = s.allocate(1000)
    assert wait_until(lambda: len(sd.names()) == 1000, timeout=20)
    d.sigkill()
    t0 = time.monotonic()
    d2 = daemon_factory("host", socket=d.socket, **kw, **sd.start_args())
    assert s.wait_resumed(30), d2.log_text()
    took = time.monotonic() - t0
    assert s.my_stats().pages_held == 1000
    print(f"\nresume of 1000 pages from systemd's store: {took:.2f} s from the restart to resumed")
    s.free(pages)
    s.close()
    c.close()


def test_no_page_is_stored_whose_name_would_not_fit_the_next_start(systemd, caplog):
    """The names systemd hands back (LISTEN_FDNAMES) are one environment
    string, which the kernel refuses past 128 KiB at exec: a store whose
    names do not fit would keep the unit from starting. The daemon stores no
    page past that budget, says so once, and what it stored still fits."""
    from kvcached_service.server.recovery.keeper import FDNAMES_BUDGET, SystemdStore, fdname

    sd = systemd(capacity=100)
    store = SystemdStore(sd.path, None, [])
    store.take_all()
    r, w = os.pipe()
    try:
        store.put([5], [r])
        assert wait_until(lambda: sd.names() == {fdname(5)}, timeout=5)
        store._name_bytes = FDNAMES_BUDGET - len(fdname(100000))  # one byte short of a 4-digit name and its ':'
        with caplog.at_level("ERROR", logger="kvcached.keeper"):
            store.put([100000, 100001], [r, w])
        time.sleep(0.2)
        assert sd.names() == {fdname(5)}
        msgs = [rec.getMessage() for rec in caplog.records if "LISTEN_FDNAMES" in rec.getMessage()]
        assert len(msgs) == 1 and "could not hand more than 1 fds back at the next start" in msgs[0], msgs
        store.drop([5])
        assert wait_until(lambda: sd.names() == set(), timeout=5)
    finally:
        store.close()
        os.close(r)
        os.close(w)


def _restart_resumes_from_the_store(daemon_factory, sd, state, backend, first, stop, **second) -> None:
    """A Survivor's session on daemon `first`, stopped by `stop`; the next
    start of the unit (systemd hands it the store): the session resumes with
    every page from systemd's store and its bytes."""
    c = first.client()
    sv = Survivor(c)
    held = sv.page_ids()
    assert wait_until(lambda: sd.names() == page_names(held), timeout=5), (sd.names(), held)
    stop()
    d2 = daemon_factory(backend, env=sd.env(), state_dir=str(state), resume_grace="20", socket=first.socket,
                        **sd.start_args(), **second)
    assert sv.s.wait_resumed(20), d2.log_text()
    log = d2.log_text()
    assert "page store: 12 of the 12 pages of the previous daemon's sessions are in the store" in log, log
    assert sv.s.my_stats().pages_held == 12 and sv.page_ids() == held
    sv.assert_intact()
    sv.r.map(20 * MiB, 4 * MiB)  # it goes on: new pages join the store
    assert wait_until(lambda: sd.names() == page_names(sv.page_ids()), timeout=5)
    assert_books(c.stats())
    sv.s.close()
    c.close()
    assert d2.stop() == 0
    assert sd.names() == set()  # no session left: the stop empties the store


@pytest.mark.parametrize("backend", ["host", "cuda"])
def test_systemctl_restart_keeps_every_page_in_systemds_store(daemon_factory, systemd, tmp_path, backend):
    """`systemctl restart` under the shipped unit with the fd-store drop-in
    (FileDescriptorStorePreserve=restart: systemd keeps the store across the
    restart): SIGTERM, a clean stop the session outlives (its pages stay in
    the store, the daemon exits 0), then the next start resumes it with
    every page and byte (CUDA test driver: chardev identity, so only the
    store can prove the pages)."""
    sd = systemd()
    state = tmp_path / "state"
    d = daemon_factory(backend, env=sd.env(), state_dir=str(state), resume_grace="20")

    def stop():
        assert d.stop() == 0, d.log_text()
        assert "left for the next start: 12 pages stay with its client" in d.log_text(), d.log_text()

    _restart_resumes_from_the_store(daemon_factory, sd, state, backend, d, stop)


def test_a_unit_restarted_into_this_version_resumes_from_systemds_store(daemon_factory, systemd, tmp_path):
    """An upgrade under systemd: the unit runs the tree before (62f7cfd,
    tests/test_upgrade.py's PREVIOUS) with systemd's fd store; its daemon
    dies (that tree's clean stop ended its sessions, so the restart into
    this version is by Restart=on-failure after a crash, SIGKILL); this
    tree's daemon starts with the store the old one filled (fd names of
    store format 1) and the session resumes with every page and byte."""
    from test_upgrade import PREVIOUS, previous_tree

    sd = systemd()
    state = tmp_path / "state"
    old = daemon_factory("host", env=sd.env(), state_dir=str(state), resume_grace="20", tree=previous_tree())
    assert PREVIOUS and old.proc.poll() is None
    _restart_resumes_from_the_store(daemon_factory, sd, state, "host", old, old.sigkill)
