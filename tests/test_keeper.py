"""The page store (issue 25, server/recovery/keeper.py): with --page-store keeper the
daemon's own fd of every lent page is kept by a process that outlives it, so
a restarted daemon resumes sessions from those fds and compares no client
fd's fstat identity: resumes work in every identity mode of the CUDA test
driver (`same` and `chardev` are what NVIDIA's driver does: every export is
an fd on one device node) and on the host backend."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from kvtest import Survivor, assert_books, wait_until
from kvcached_service import errors

MiB = 1 << 20

# This test process's own libcuda (the in-process client's) is the test
# driver in its default mode, so a client that maps pages runs against a
# daemon in that mode; the other modes are played by a raw client below.
CASES = [("host", None), ("cuda", None)]


def _keeper_pid(state) -> int:
    text = (state / "keeper.log").read_text()
    return int(re.findall(r"keeper pid (\d+)", text)[-1])


def _start(daemon_factory, backend, mode, **kw):
    env = {"KVCACHED_TESTDRV_FD_IDENTITY": mode} if mode else None
    return daemon_factory(backend, env=env, page_store="keeper", resume_grace="20", **kw)


@pytest.mark.parametrize("backend,mode", CASES, ids=["host", "cuda"])
def test_sigkilled_daemon_resumes_every_page_from_the_store(daemon_factory, tmp_path, backend, mode):
    """SIGKILL the daemon while a client holds region pages and loose pages
    with data in them; the restarted daemon takes the pages from the keeper:
    the session resumes with every page and its bytes. Then a clean
    shutdown empties the store and the keeper exits."""
    state = tmp_path / "state"
    d = _start(daemon_factory, backend, mode, state_dir=str(state))
    c = d.client()
    sv = Survivor(c)  # its freed page leaves the store
    s, r, loose = sv.s, sv.r, sv.loose
    held = sv.page_ids()
    keeper = _keeper_pid(state)
    d.sigkill()
    assert os.path.exists(f"/proc/{keeper}")  # the keeper outlives the daemon
    d2 = _start(daemon_factory, backend, mode, state_dir=str(state), socket=d.socket)
    assert s.wait_resumed(20), d2.log_text()
    log = d2.log_text()
    assert "page store: 12 of the 12 pages of the previous daemon's sessions are in the store" in log, log
    assert _keeper_pid(state) == keeper  # the same keeper served the new daemon
    assert s.my_stats().pages_held == 12
    assert sv.page_ids() == held
    sv.assert_intact()
    r.map(20 * MiB, 4 * MiB)  # and it goes on: grow, free
    s.free(loose)
    r.close()
    st = c.stats()
    assert st.total.pages_in_use == 0
    assert_books(st)
    s.close()
    c.close()
    assert d2.stop() == 0
    assert wait_until(lambda: not os.path.exists(f"/proc/{keeper}"), timeout=10), "the keeper outlived a clean shutdown"
    assert not (state / "keeper.sock").exists()


@pytest.mark.cuda  # the CUDA test set: the driver's own identity on any libcuda, the others on the test driver
@pytest.mark.parametrize("mode", ["distinct", "file", "same", None], ids=["distinct", "file", "same", "this-driver"])
def test_every_identity_mode_resumes_from_the_store_and_checks_no_client_fd(daemon_factory, tmp_path, mode):
    """The CUDA test driver in each identity mode (`same`, and its default
    `chardev`: every export an fd on one device node, as NVIDIA's driver
    does), and whatever driver this is (`this-driver`, no knob). A raw client
    claims its pages after a daemon SIGKILL and re-sends NO fds: with the
    store the daemon adopts them all from its keeper (without it, `same` and
    `chardev` refused; tests/cuda/test_identity.py). A claim for a page the
    session never held is still refused, and nothing is adopted then."""
    import grpc

    from kvcached_service._generated.kvcached.v1 import kvcached_pb2 as pb
    from kvcached_service._generated.kvcached.v1 import kvcached_pb2_grpc as pb_grpc
    from kvcached_service import fdchannel

    state = tmp_path / "state"
    d = _start(daemon_factory, "cuda", mode, state_dir=str(state))
    c = d.client()
    s = c.open_session("raw")
    resp, fds = s.allocate_fds(3)
    fdchannel.close_fds(fds)  # the client keeps nothing to re-send
    sid, token, ids = s.id, s.resume_token, list(resp.page_ids)
    s._closed = True  # we play the client: no automatic resume
    d.sigkill()
    d2 = _start(daemon_factory, "cuda", mode, state_dir=str(state), socket=d.socket)

    def resume(page_ids):
        import socket as so

        ch = so.socket(so.AF_UNIX, so.SOCK_SEQPACKET)
        ch.connect(d2.fd_socket)
        try:
            hello = fdchannel.recv_record(ch)
            stub = pb_grpc.KVCachedStub(grpc.insecure_channel(f"unix:{d2.socket}"))
            return stub.ResumeSession(pb.ResumeSessionRequest(channel_secret=hello.secret, session_id=sid, resume_token=token,
                                                              page_ids=page_ids), timeout=10)
        finally:
            ch.close()

    with pytest.raises(grpc.RpcError) as info:
        resume(ids + [max(ids) + 100])
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED and "was not held by session" in info.value.details()
    r = resume(ids)
    assert (r.pages_adopted, r.pages_forgotten) == (3, 0), r
    assert "same identity" not in d2.log_text()
    with d2.client() as c2:  # the resumed session ended with the raw channel: its pages came back
        assert wait_until(lambda: c2.stats().total.pages_in_use == 0, timeout=10)
        assert_books(c2.stats())
    c.close()


@pytest.mark.parametrize("backend,mode", [("host", None), ("cuda", "same"), ("cuda", None)], ids=["host", "cuda-same", "cuda"])
def test_keeper_killed_too_falls_back_to_the_clients_fds(daemon_factory, tmp_path, backend, mode):
    """The daemon and its keeper both SIGKILLed: the new daemon starts a new,
    empty keeper and says the pages are not in the store; resumes are
    checked by the fds clients re-send as without a store: adopted where
    fds identify pages (host), refused with the documented error where they
    do not (`same`): the client reopens and the daemon serves on. `cuda`:
    the driver's own identity, whichever it is (no knob: any libcuda)."""
    state = tmp_path / "state"
    d = _start(daemon_factory, backend, mode, state_dir=str(state))
    c = d.client()
    s = c.open_session("both-killed")
    pages = s.allocate(2)
    pages[0].write(0, b"data")
    keeper = _keeper_pid(state)
    d.sigkill()
    os.kill(keeper, signal.SIGKILL)
    d2 = _start(daemon_factory, backend, mode, state_dir=str(state), socket=d.socket)
    assert wait_until(lambda: "page store: 0 of the 2 pages" in d2.log_text(), timeout=10), d2.log_text()
    assert "2 are not (the store was restarted or gone, or was full)" in d2.log_text()
    resumed = s.wait_resumed(20)
    if backend == "host" or (mode is None and resumed):  # fds that identify their pages
        assert resumed and s.my_stats().pages_held == 2 and pages[0].read(0, 4) == b"data"
        if backend == "cuda":
            assert "exported fds identify their pages" in d2.log_text()
    else:
        assert not resumed
        with pytest.raises(errors.FailedPrecondition, match="could not be resumed.*same identity"):
            s.allocate(1)
        with c.open_session("reopened") as s2:
            s2.free(s2.allocate(2))
    assert_books(c.stats())
    c.close()


@pytest.mark.parametrize("backend,mode", CASES, ids=["host", "cuda"])
def test_a_keeper_that_dies_is_started_again_with_every_lent_page(daemon_factory, tmp_path, backend, mode):
    """The keeper SIGKILLed while the daemon runs: within seconds the daemon
    starts a new one and puts every page lent now in it (said once), pages
    lent afterwards go there too, and a daemon SIGKILL after that resumes
    every page from the new keeper (CUDA test driver in its default
    identity, chardev: no client fd could prove a page)."""
    state = tmp_path / "state"
    d = _start(daemon_factory, backend, mode, state_dir=str(state))
    c = d.client()
    s = c.open_session("keeper-died")
    r = s.region(16 * MiB)
    r.map(0, 8 * MiB)
    r.write(0, b"before")
    first = _keeper_pid(state)
    os.kill(first, signal.SIGKILL)
    assert wait_until(lambda: "page store: a new keeper holds the 4 pages lent now" in d.log_text(), timeout=15), d.log_text()
    second = _keeper_pid(state)
    assert second != first and os.path.exists(f"/proc/{second}")
    r.map(8 * MiB, 4 * MiB)  # lent to the new keeper directly
    r.write(10 * MiB, b"after")
    held = set(r.page_ids())
    d.sigkill()
    d2 = _start(daemon_factory, backend, mode, state_dir=str(state), socket=d.socket)
    assert s.wait_resumed(20), d2.log_text()
    assert "page store: 6 of the 6 pages of the previous daemon's sessions are in the store" in d2.log_text(), d2.log_text()
    assert set(r.page_ids()) == held and s.my_stats().pages_held == 6
    assert r.read(0, 6) == b"before" and r.read(10 * MiB, 5) == b"after"
    r.close()
    assert_books(c.stats())
    s.close()
    c.close()


def test_a_budget_beyond_the_keepers_open_files_is_named_at_start(daemon_factory, tmp_path):
    """The keeper holds one fd per lent page and raises its soft
    RLIMIT_NOFILE to the hard limit (20,000 on the development machines,
    not raisable here). A budget with more pages than that gets a warning
    at start naming both numbers and what to raise; one below it does not."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    pages = hard + 1000
    d = _start(daemon_factory, "host", None, state_dir=str(tmp_path / "big"), page_size="4KiB",
               memory_limit=f"{pages * 4}KiB")
    assert f"page store: the budget is {pages} pages but a keeper may hold at most ~{hard - 64} fds" in d.log_text(), d.log_text()
    d2 = _start(daemon_factory, "host", None, state_dir=str(tmp_path / "small"), memory_limit="64MiB")
    assert "page store: the budget is" not in d2.log_text()
