"""Hostile tenants (issue 9; invariants 2 and 3 across uids). Real processes
of other uids (`nobody`, `daemon`), made by tests/helpers/hostile.py
dropping root's privileges after its imports (the tests run as root).

What a tenant of another uid must not be able to do:
- connect at all without the socket group (mode 0660);
- receive pages of, or read any byte of, another tenant: not with a token
  stolen from it (the fds only ever travel on the victim's own fd channel),
  not by grabbing the whole budget the moment a victim dies;
- free, see or re-limit another tenant's pages or session with its own
  session;
- use a SessionRef stolen from another uid at all (PERMISSION_DENIED on
  every rpc: the control socket's front door names each caller's uid), or
  bind a session to another uid's fd channel with its secret;
- by default, change a session's pages over gRPC even with its SessionRef
  and its uid (page operations only on the session's own fd channel);
- hold more than its share of control connections (test_limits.py).
"""

from __future__ import annotations

import json
import pwd
import signal
import subprocess

import pytest

from kvtest import HELPERS, PY, assert_books, require_uids_share_the_device, wait_until

NOBODY = pwd.getpwnam("nobody")
DAEMON_USER = pwd.getpwnam("daemon")
AS_NOBODY = {"KVCACHED_TEST_AS_UID": f"{NOBODY.pw_uid}:{NOBODY.pw_gid}"}
AS_DAEMON = {"KVCACHED_TEST_AS_UID": f"{DAEMON_USER.pw_uid}:{DAEMON_USER.pw_gid}"}


def run(d, *args, env=None, timeout=60) -> dict:
    p = subprocess.run([PY, str(HELPERS / "hostile.py"), *args], env=dict(d.client_env(), **(env or {})),
                       capture_output=True, text=True, timeout=timeout)
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    assert lines, f"hostile.py {args} printed nothing (exit {p.returncode}):\n{p.stderr[-3000:]}"
    return json.loads(lines[-1])


def spawn(d, *args, env=None) -> subprocess.Popen:
    return subprocess.Popen([PY, str(HELPERS / "hostile.py"), *args], env=dict(d.client_env(), **(env or {})),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def readline(p: subprocess.Popen) -> dict:
    line = p.stdout.readline()
    assert line, p.stderr.read()
    return json.loads(line)


def test_socket_group_decides_who_can_connect(daemon_factory):
    """0660 with the client group: a member connects (both sockets) and is
    served; a uid outside the group cannot even connect()."""
    d = daemon_factory("host", shared_dir=True, socket_mode="0660", socket_group="nogroup")
    member = run(d, "connect", env=AS_NOBODY)
    outsider = run(d, "connect", env=AS_DAEMON)
    assert member == {"control": "connected", "fd": "connected"}, member
    assert outsider == {"control": "EACCES", "fd": "EACCES"}, outsider
    grab = run(d, "grab", "2", "5", env=AS_NOBODY)  # the member really is served
    assert grab["uid"] == NOBODY.pw_uid and not grab["nonzero"]


def _victim(d, n: int, byte: int, env=None) -> tuple[subprocess.Popen, dict]:
    v = spawn(d, "victim", str(n), str(byte), env=env)
    return v, readline(v)


def _intact(v: subprocess.Popen) -> bool:
    v.stdin.write("\n")
    v.stdin.flush()
    return readline(v)["intact"]


def test_stolen_ref_gives_no_pages_and_no_bytes(daemon_factory):
    """An attacker of another uid holding a victim's SessionRef (id and
    token) can call gRPC with it but has no access to the victim's fd
    channel: whatever it does, no page fd ever reaches it, and when it then
    takes the whole budget it gets only fresh, zeroed pages."""
    d = daemon_factory("host", shared_dir=True, socket_mode="0666", memory_limit="32MiB")  # 16 pages
    v, info = _victim(d, 6, 0xA5)
    res = run(d, "stolen", str(info["session"]), info["token"], *map(str, info["pages"]), env=AS_NOBODY)
    print("\nstolen ref, as nobody:", res)
    assert res["records_on_own_channel"] == [], "pages reached a process that does not own the session"
    victim_ids = set(info["pages"]) | set(res["Allocate_ids"])
    # whatever the stolen ref achieved, the victim's bytes never reach nobody:
    # the victim dies, nobody takes the whole budget at once
    v.kill()
    v.wait()
    grab = run(d, "grab", "16", "5", env=AS_NOBODY)
    assert not grab["nonzero"], f"nobody read non-zero pages {grab['nonzero']}"
    assert not set(grab["pages"]) & victim_ids, "a page of root's session went to nobody"
    with d.client() as c:
        st = c.stats()
        assert_books(st)
        assert st.total.pages_in_use == 0


@pytest.mark.parametrize("grpc_page_ops", [False, True], ids=["default", "grpc-page-ops"])
def test_stolen_ref_from_another_uid_is_refused(daemon_factory, grpc_page_ops):
    """The rule (invariant 3): a SessionRef is good only for the uid that
    opened the session. Another uid using a stolen one gets
    PERMISSION_DENIED on every rpc, in the default mode and with
    --grpc-page-ops alike, and the victim's pages stay mapped and intact.
    grpcio tells a servicer nothing about a Unix-socket peer; the control
    socket's front door (server/transports/control.py) reads SO_PEERCRED of every
    connection and names the caller to the servicer, so the daemon checks
    the caller's uid against the session's."""
    d = daemon_factory("host", shared_dir=True, socket_mode="0666", memory_limit="32MiB", grpc_page_ops=grpc_page_ops)
    v, info = _victim(d, 6, 0x5A)
    try:
        res = run(d, "stolen", str(info["session"]), info["token"], *map(str, info["pages"]), env=AS_NOBODY)
        print(f"\nstolen ref ({'--grpc-page-ops' if grpc_page_ops else 'default'}), as nobody:", res)
        intact = _intact(v)
        wrong = {k: res[k] for k in ("GetStats", "Allocate", "Watch", "Free", "CloseSession") if res[k] != "PERMISSION_DENIED"}
        assert not wrong and intact, f"a stolen SessionRef works for another uid: {wrong}; victim's bytes intact: {intact}"
        assert res["records_on_own_channel"] == []
        with d.client() as c, c.open_session("admin-view") as me:
            victim = [s for s in me.stats().sessions if s.id == info["session"]]
            assert victim and victim[0].pages_held == 6
    finally:
        v.kill()
        v.wait()


def test_by_default_a_stolen_ref_of_the_same_uid_cannot_change_pages(daemon_factory):
    """The default mode takes Allocate, Free and CloseSession only as
    requests on the session's own fd channel, whose peer the kernel names:
    even a process of the session's own uid holding its SessionRef cannot
    allocate against it, free its pages (zeroing them under its mapping) or
    close it over gRPC (FAILED_PRECONDITION); it can read the session's
    stats and Watch it, which its uid could do anyway (ptrace)."""
    d = daemon_factory("host", shared_dir=True, socket_mode="0666", memory_limit="32MiB")
    v, info = _victim(d, 6, 0x3C)
    try:
        res = run(d, "stolen", str(info["session"]), info["token"], *map(str, info["pages"]))  # root, as the victim
        print("\nstolen ref, same uid, default mode:", res)
        for rpc in ("Allocate", "Free", "CloseSession"):
            assert res[rpc] == "FAILED_PRECONDITION", (rpc, res)
        assert res["GetStats"] == "OK" and res["Watch"] == "OK", res
        assert res["records_on_own_channel"] == []
        assert _intact(v), "the victim's pages changed"
        with d.client() as c:
            me = [s for s in c.open_session("admin-view").stats().sessions if s.id == info["session"]]
            assert me and me[0].pages_held == 6
    finally:
        v.kill()
        v.wait()


def test_a_channel_secret_opens_a_session_only_for_its_own_uid(daemon_factory):
    """The secret of root's fd channel, in the hands of nobody, cannot bind
    a session to root's channel (PERMISSION_DENIED, naming both uids); root
    can still use it."""
    import socket as so

    from kvcached_service import fdchannel

    d = daemon_factory("host", shared_dir=True, socket_mode="0666")
    ch = so.socket(so.AF_UNIX, so.SOCK_SEQPACKET)
    ch.connect(d.fd_socket)
    hello = fdchannel.recv_record(ch)
    res = run(d, "opensecret", hello.secret.hex(), env=AS_NOBODY)
    assert res["OpenSession"] == "PERMISSION_DENIED", res
    assert "comes from uid 65534, but the fd channel of that secret belongs to uid 0" in res["OpenSession_msg"], res
    res = run(d, "opensecret", hello.secret.hex())
    assert res["OpenSession"] == "OK", res
    ch.close()


def test_own_session_cannot_free_see_or_limit_another_uids(daemon_factory):
    d = daemon_factory("host", shared_dir=True, socket_mode="0666", memory_limit="32MiB")
    v, info = _victim(d, 4, 0x3C)
    try:
        res = run(d, "own", ",".join(map(str, info["pages"])), str(info["session"]), env=AS_NOBODY)
        print("\nown session, as nobody:", res)
        assert res["admin"] is False
        assert res["Free"] == "NOT_FOUND" and "nothing was freed" in res["Free_msg"], res
        assert res["sessions_seen"] == [res["own_session"]], "a non-admin session sees other sessions"
        assert res["SetSessionLimits"] == "PERMISSION_DENIED" and res["RequestShrink"] == "PERMISSION_DENIED", res
        assert _intact(v)
    finally:
        v.kill()
        v.wait()
    with d.client() as c:
        assert wait_until(lambda: c.stats().total.pages_in_use == 0, timeout=1)
        assert_books(c.stats())


def test_a_uid_sees_and_may_shrink_its_own_uids_sessions_only(daemon_factory):
    """The rule Ollama relies on (it reads and shrinks its own llama-server
    children without being an admin): a non-admin session sees itself first,
    then the other sessions of its uid, never another uid's; it may ask a
    session of its own uid to shrink, not another uid's; limits stay admin."""
    d = daemon_factory("host", shared_dir=True, socket_mode="0666", memory_limit="32MiB")
    v, info = _victim(d, 4, 0x3C)  # root's session
    try:
        res = run(d, "sameuid", str(info["session"]), env=AS_NOBODY)
        print("\nsame uid, as nobody:", res)
        assert res["admin"] is False
        assert res["sessions_seen"] == [res["server"], res["runner"]], res
        assert res["RequestShrink_own_uid"] == "OK" and res["pages_requested"] >= 1, res
        assert res["RequestShrink_other_uid"] == "PERMISSION_DENIED", res
        assert "only shrink sessions of its own uid" in res["RequestShrink_other_uid_msg"], res
        assert res["SetSessionLimits_own_uid"] == "PERMISSION_DENIED", res
        assert _intact(v)
    finally:
        v.kill()
        v.wait()


@pytest.mark.parametrize("victim_env,attacker_env", [(AS_DAEMON, AS_NOBODY), ({}, AS_NOBODY)], ids=["daemon-to-nobody", "root-to-nobody"])
def test_victim_dies_attacker_takes_whole_budget_gets_only_fresh_zero_pages(daemon_factory, backend, victim_env, attacker_env):
    """A victim fills the whole budget with its bytes and is SIGKILLed; an
    attacker of another uid already waiting allocates the whole budget the
    moment it can: every page it gets is new (not one of the victim's ids)
    and every byte reads zero."""
    require_uids_share_the_device(backend)
    d = daemon_factory(backend, shared_dir=True, socket_mode="0666", memory_limit="32MiB")  # 16 pages of 2 MiB
    v, info = _victim(d, 16, 0xEE, env=victim_env)
    g = subprocess.Popen([PY, str(HELPERS / "hostile.py"), "grab", "16", "10"], env=dict(d.client_env(), **attacker_env),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with d.client() as c:
        assert wait_until(lambda: any(s.uid == NOBODY.pw_uid for s in c.stats().sessions) or c.stats().sessions_open >= 2, timeout=10)
    v.send_signal(signal.SIGKILL)
    v.wait()
    out, err = g.communicate(timeout=30)
    assert g.returncode == 0, err[-3000:]
    grab = json.loads(out.splitlines()[-1])
    print(f"\n{backend}: attacker got the whole budget {grab['waited']:.3f} s after starting to try ({grab['tries']} tries)")
    assert grab["uid"] == NOBODY.pw_uid
    assert not set(grab["pages"]) & set(info["pages"]), "a page of the dead victim went to another uid"
    assert not grab["nonzero"], f"pages with the victim's bytes: {grab['nonzero']}"
    with d.client() as c:
        st = c.stats()
        assert_books(st)
        assert st.total.pages_released_total >= 16  # the victim's pages were released, not reused
        assert st.total.pages_in_use == 0
