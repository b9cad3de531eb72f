"""Invariants 1-3 across real processes: no page in two live sessions, pages
read as zeros when they change session, never handed across uids while the
first uid may still hold them, and data never leaks between tenants."""

from __future__ import annotations

import json
import os
import pwd
import subprocess

import pytest

from kvtest import PY, HELPERS, assert_books, require_uids_share_the_device, wait_until

NOBODY = pwd.getpwnam("nobody")
# These tests run a client as another uid, which needs root (CI and the dev
# machines run as root; elsewhere run them under sudo).


def test_two_processes_do_not_see_each_others_data(daemon):
    a = daemon.spawn_client("client_proc.py", "hold", "4")
    b = daemon.spawn_client("client_proc.py", "hold", "4")
    ra = json.loads(a.stdout.readline())
    rb = json.loads(b.stdout.readline())
    assert not set(ra["pages"]) & set(rb["pages"]), "a page is in two live sessions"
    # each verifies its own pattern (written with its own pid) is intact
    out_a, _ = a.communicate("\n", timeout=30)
    out_b, _ = b.communicate("\n", timeout=30)
    assert json.loads(out_a.splitlines()[-1])["intact"]
    assert json.loads(out_b.splitlines()[-1])["intact"]


def test_page_freed_by_one_process_reads_zero_in_the_next(daemon):
    first = json.loads(daemon.run_client("client_proc.py", "write-free", "6", "171").stdout)
    second = json.loads(daemon.run_client("client_proc.py", "zeros", "6").stdout)
    assert set(first["pages"]) & set(second["pages"]), "expected the same uid to get the freed pages back"
    assert second["zeros"], "a page freed by another session must read as zeros"
    with daemon.client() as c:
        assert_books(c.stats())


AS_NOBODY = {"KVCACHED_TEST_AS_UID": f"{NOBODY.pw_uid}:{NOBODY.pw_gid}"}


def test_pages_never_cross_uids_while_first_uid_holds_them(daemon_factory, backend):
    require_uids_share_the_device(backend)
    d = daemon_factory(backend, shared_dir=True, socket_mode="0666", memory_limit="32MiB")  # 16 pages
    env = dict(d.client_env(), **AS_NOBODY)
    other = subprocess.Popen(
        [PY, str(HELPERS / "client_proc.py"), "keep-after-free", "10", "90"],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    line = other.stdout.readline()
    assert line, other.stderr.read()
    theirs = set(json.loads(line)["pages"])
    with d.client() as c, c.open_session("root-tenant") as s:
        st = c.stats()
        assert st.total.pages_pooled == 10  # nobody's freed pages, pooled for nobody only
        mine = s.allocate(16)  # the whole budget: nobody's 10 pooled pages must be replaced, not reused
        assert not theirs & {p.id for p in mine}, "a page went to another uid while the first may still hold it"
        assert all(p.read() == bytes(p.size) for p in mine)
        other.stdin.write("\n")
        other.stdin.flush()
        still = json.loads(other.stdout.readline())["still"]
        assert still == [90] * 10  # nobody still sees its own bytes in the pages it kept...
        assert all(p.read(0, 4096) == bytes(4096) for p in mine)  # ...and they never reach root's pages
        st = c.stats()
        assert st.total.pages_released_total >= 10
        assert_books(st)
        s.free(mine)
    other.communicate("\n", timeout=30)


def test_free_and_allocate_race_across_uids_and_every_page_reads_zero(daemon_factory, backend):
    """Two uids free and allocate as fast as they can in a budget too small
    for both to keep their pages pooled: a Free is answered before its
    pages are zeroed (the pool's background zeroer), so Allocates of both
    uids race the zeroing. Every page either receives reads zero in every
    byte, no page id goes to both uids, and the books add up."""
    require_uids_share_the_device(backend)
    d = daemon_factory(backend, shared_dir=True, socket_mode="0666", memory_limit="24MiB")  # 12 pages: 7 + 7 do not fit
    procs = [
        subprocess.Popen([PY, str(HELPERS / "client_proc.py"), "churn", "3", "7", str(byte)],
                         env=dict(d.client_env(), **env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for byte, env in ((0xA1, {}), (0x5B, AS_NOBODY))
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out.splitlines()[-1]))
    for r in results:
        assert r["rounds"] > 5 and r["dirty"] == 0, r
    assert not set(results[0]["pages"]) & set(results[1]["pages"]), "a page id went to two uids"
    with d.client() as c:
        wait_until(lambda: c.stats().total.pages_in_use == 0, timeout=5)
        st = c.stats()
        assert st.total.pages_released_total > 0  # the uids took pages from each other's pool: released, not reused
        assert_books(st)


def test_uid_not_in_allow_list_is_refused(daemon_factory):
    d = daemon_factory("host", shared_dir=True, socket_mode="0666", allowed_uids=str(os.getuid()))
    proc = subprocess.run(
        [PY, str(HELPERS / "client_proc.py"), "zeros", "1"], env=dict(d.client_env(), **AS_NOBODY), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0
    assert f"uid {NOBODY.pw_uid} is not allowed to use this daemon" in proc.stderr
    with d.client() as c, c.open_session("ok") as s:  # others still served
        s.free(s.allocate(1))


def test_socket_mode_keeps_other_uids_out(daemon_factory):
    d = daemon_factory("host", shared_dir=True)  # 0660 root:root
    proc = subprocess.run(
        [PY, str(HELPERS / "client_proc.py"), "zeros", "1"], env=dict(d.client_env(), **AS_NOBODY), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0
    assert "no kvcached daemon answers" in proc.stderr or "Permission denied" in proc.stderr
