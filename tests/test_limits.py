"""Resource exhaustion (issue 9): tenants that open thousands of fd channels
and sessions, never bind or never read their channels, flood ADOPT records,
hold their maximum and ignore reclaim, or send huge messages. Each limit
applies with a precise error, and the daemon and the other tenants keep
working (a bystander allocates and frees throughout).

Limits and their defaults (kvcached_service/config.py):
  max_grpc_connections  1024   control (gRPC) connections open at once, all uids
  max_grpc_connections_per_uid 256  ... per uid (SO_PEERCRED at the control socket's front door)
  grpc_idle_timeout     120 s  a control connection with no call in flight is closed
  max_sessions          4096   fd channels (bound or not) and sessions in total
  max_sessions_per_uid  1024   fd channels (bound or not) per uid
  channel_bind_timeout  30 s   an fd channel without OpenSession is closed
  fd_send_timeout       5 s    a client leaving its channel full loses its session
  max_pages_per_request 65536  pages in one Allocate
  max_bytes (session)   0 = the device budget
  gRPC messages         4 MiB  (grpc.max_receive_message_length, main.py)
  labels                16, keys/values up to 256 bytes; name 1-128 chars
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time

import grpc
import pytest

from kvtest import HELPERS, PY, ROOT, assert_books, wait_until
from kvcached_service import errors, fdchannel
from kvcached_service._generated.kvcached.v1 import kvcached_pb2 as pb
from kvcached_service._generated.kvcached.v1 import kvcached_pb2_grpc as pb_grpc
from test_hostile import AS_DAEMON, AS_NOBODY, NOBODY
from helpers.raw import ref, stub

C = grpc.StatusCode


def daemon_fds(d) -> int:
    return len(os.listdir(f"/proc/{d.proc.pid}/fd"))


def daemon_rss(d) -> int:
    with open(f"/proc/{d.proc.pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class Bystander:
    """A session that allocates, checks and frees in a loop on a thread;
    counts rounds and records any failure."""

    def __init__(self, d, pages: int = 2):
        self.client = d.client()
        self.s = self.client.open_session("bystander")
        self.pages = pages
        self.rounds = 0
        self.failures: list[str] = []
        self.worst = 0.0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                ps = self.s.allocate(self.pages)
                ps[0].write(0, b"by")
                assert ps[0].read(0, 2) == b"by"
                self.s.free(ps)
                self.rounds += 1
            except Exception as exc:  # noqa: BLE001
                self.failures.append(f"{type(exc).__name__}: {exc}")
            self.worst = max(self.worst, time.monotonic() - t0)
            time.sleep(0.01)

    def settled(self) -> "Bystander":
        """After its first round (its pages exist: fd baselines hold)."""
        assert wait_until(lambda: self.rounds >= 1, timeout=5), self.failures
        return self

    def stop(self) -> None:
        self._stop.set()
        self._t.join(10)
        self.s.close()
        self.client.close()
        assert not self.failures, f"the bystander failed: {self.failures[:5]}"
        assert self.rounds >= 5, f"the bystander got only {self.rounds} rounds"


def hog(d, n: int, do_open: bool, env: dict) -> tuple[subprocess.Popen, dict]:
    p = subprocess.Popen([PY, str(HELPERS / "hog.py"), str(n), "1" if do_open else "0"], env=dict(d.client_env(), **env),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert line, p.stderr.read()
    return p, json.loads(line)


def end(p: subprocess.Popen) -> None:
    p.stdin.write("\n")
    p.stdin.flush()
    p.wait(30)


def test_thousands_of_channels_and_sessions_per_uid(daemon_factory):
    """nobody opens 1,200 fd channels and a session on each it gets: the
    1,025th and later are refused with RESOURCE_EXHAUSTED naming the limit;
    root's bystander is served all along; everything goes when nobody exits."""
    d = daemon_factory("host", shared_dir=True, socket_mode="0666", log_level="WARNING")
    by = Bystander(d).settled()
    base = daemon_fds(d)
    t0 = time.monotonic()
    p, res = hog(d, 1200, True, AS_NOBODY)
    took = time.monotonic() - t0
    print(f"\n1200 channels as nobody: {res} in {took:.1f} s; bystander {by.rounds} rounds, worst {by.worst * 1000:.0f} ms")
    assert res["hello"] == 1024 and res["opened"] == 1024
    msg = f"8: uid {NOBODY.pw_uid} already has 1024 fd channels open (max_sessions_per_uid=1024)"
    assert res["errors"] == {msg: 176}, res["errors"]
    with d.client() as c:
        assert c.stats().sessions_open == 1024 + 1
    end(p)
    with d.client() as c:
        assert wait_until(lambda: c.stats().sessions_open == 1, timeout=5), c.stats().sessions_open
    by.stop()
    assert wait_until(lambda: daemon_fds(d) <= base, timeout=3), f"{daemon_fds(d) - base} fds left behind"


def test_max_sessions_caps_all_uids_per_uid_limit_protects_others(daemon_factory):
    """max_sessions counts every channel; with max_sessions_per_uid below it
    one uid cannot take them all: nobody gets its 40, the uid `daemon` gets
    what is left of 60 and is then refused naming max_sessions, root's
    bystander (opened first) keeps working."""
    d = daemon_factory("host", shared_dir=True, socket_mode="0666", max_sessions="60", max_sessions_per_uid="40")
    by = Bystander(d).settled()
    p1, r1 = hog(d, 50, True, AS_NOBODY)
    p2, r2 = hog(d, 30, False, AS_DAEMON)
    print(f"\nmax_sessions 60, per uid 40: nobody {r1}, daemon {r2}")
    assert r1["hello"] == 40 and r1["errors"] == {f"8: uid {NOBODY.pw_uid} already has 40 fd channels open (max_sessions_per_uid=40)": 10}
    left = 60 - 40 - 1  # the bystander's channel counts
    assert r2["hello"] == left and r2["errors"] == {"8: the daemon already has 60 channels open (max_sessions)": 30 - left}, r2
    # root (the daemon's own uid) is not exempt from the total: a new session is refused precisely
    with d.client() as c:
        with pytest.raises(errors.ResourceExhausted, match=r"already has 60 channels open \(max_sessions\)"):
            c.open_session("one-too-many")
    end(p1)
    end(p2)
    with d.client() as c, c.open_session("after") as s:  # room again
        s.free(s.allocate(1))
    by.stop()


def test_unbound_channels_are_closed_after_channel_bind_timeout(daemon_factory):
    d = daemon_factory("host", channel_bind_timeout="1")
    by = Bystander(d).settled()
    base = daemon_fds(d)
    socks = []
    for _ in range(300):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(d.fd_socket)
        s.settimeout(5)
        assert isinstance(fdchannel.recv_record(s), fdchannel.Hello)
        socks.append(s)
    assert daemon_fds(d) >= base + 300
    t0 = time.monotonic()
    got = [fdchannel.recv_record(s) for s in socks]
    waited = time.monotonic() - t0
    eofs = sum(1 for s in socks if fdchannel.recv_record(s) is None)
    print(f"\n300 unbound channels: closed after {waited:.2f} s")
    assert all(isinstance(r, fdchannel.Error) and r.code == 9 and r.message == "no OpenSession within 1 s" for r in got), got[:3]
    assert eofs == 300 and waited < 2.5
    for s in socks:
        s.close()
    assert wait_until(lambda: daemon_fds(d) <= base, timeout=3), f"{daemon_fds(d) - base} fds left behind"
    by.stop()


def _raw_session(d, stub, name):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(d.fd_socket)
    hello = fdchannel.recv_record(s)
    ref = stub.OpenSession(pb.OpenSessionRequest(channel_secret=hello.secret, name=name), timeout=10).session
    return s, ref


def test_sessions_that_never_read_their_fds(daemon_factory):
    """A session asks for 15,000 4 KiB pages and never reads its fd channel,
    next to one that reads nothing but asked little: the big Allocate fails UNAVAILABLE after fd_send_timeout
    naming the reason, the sessions end, every page returns, no descriptor
    stays behind; the bystander is never held up meanwhile."""
    # A full socket takes ~50 PAGES records (~12,000 fds, the daemon's send
    # buffer); this machine's hard RLIMIT_NOFILE is 20,000 and cannot be
    # raised here (no CAP_SYS_RESOURCE), so one session is stuck at a time.
    d = daemon_factory("host", page_size="4KiB", memory_limit="256MiB", fd_send_timeout="1", log_level="WARNING", grpc_page_ops=True)
    stub = pb_grpc.KVCachedStub(grpc.insecure_channel(f"unix:{d.socket}"))
    by = Bystander(d).settled()
    time.sleep(0.2)
    per_page = 1
    st0 = stub.GetStats(pb.GetStatsRequest(), timeout=10).total
    base = daemon_fds(d) - per_page * (st0.pages_pooled + st0.pages_in_use)
    sessions = [_raw_session(d, stub, f"deaf-{i}") for i in range(2)]
    results = [None] * 2

    def ask(i):
        sock, ref = sessions[i]
        t0 = time.monotonic()
        try:
            stub.Allocate(pb.AllocateRequest(session=ref, num_pages=15_000 if i == 0 else 300), timeout=30)
            results[i] = ("OK", "", time.monotonic() - t0)
        except grpc.RpcError as exc:
            results[i] = (exc.code().name, exc.details(), time.monotonic() - t0)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    print(f"\nnon-reading sessions: {[(r[0], round(r[2], 2)) for r in results]}; bystander {by.rounds} rounds, worst {by.worst * 1000:.0f} ms")
    code, details, took = results[0]
    assert code == "UNAVAILABLE", (code, details)
    assert "could not deliver pages on session" in details and "did not read its fd channel for 1 s" in details, details
    assert 1.0 <= took < 5
    assert results[1][0] == "OK"  # fds waiting in a socket that has room are fine: that session lives on
    assert by.worst < 0.9, f"the bystander waited {by.worst:.2f} s for one round"
    st = stub.GetStats(pb.GetStatsRequest(), timeout=10)
    assert st.sessions_open == 2 and st.total.pages_in_use <= by.pages + 300
    by.stop()
    for sock, _ in sessions:
        sock.close()
    assert wait_until(lambda: stub.GetStats(pb.GetStatsRequest(), timeout=10).total.in_use_bytes == 0, timeout=3)
    t = stub.GetStats(pb.GetStatsRequest(), timeout=10).total
    with d.client() as c:
        assert_books(c.stats())
    assert wait_until(lambda: daemon_fds(d) - per_page * (t.pages_pooled + t.pages_in_use) <= base, timeout=3), \
        f"{daemon_fds(d)} fds for {t.pages_pooled + t.pages_in_use} pages; baseline {base} + pages"


def test_adopt_flood_cannot_fill_the_daemon_fd_table(daemon_factory, tmp_path):
    """One descriptor sent 25,300 times as ADOPT records (more than the
    daemon's RLIMIT_NOFILE here) on one channel, for a session that is not
    waiting to be resumed: the daemon keeps none of them and can still
    create pages and accept channels."""
    d = daemon_factory("host", state_dir=str(tmp_path / "state"), memory_limit="64MiB")
    by = Bystander(d).settled()
    with open(f"/proc/{d.proc.pid}/limits") as f:
        nofile = int(next(x for x in f if x.startswith("Max open files")).split()[3])
    base = daemon_fds(d)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(d.fd_socket)
    s.settimeout(10)
    fdchannel.recv_record(s)
    r, w = os.pipe()
    sent = 0
    for i in range(100):
        ids = list(range(i * 253 + 1, i * 253 + 254))
        fdchannel.send_record(s, fdchannel.encode_adopt(424242, i * 253, 25300, ids), [r] * 253)
        sent += 253
    print(f"\nADOPT flood: {sent} descriptors sent; daemon RLIMIT_NOFILE {nofile}; daemon fds {daemon_fds(d)} (baseline {base})")
    assert wait_until(lambda: daemon_fds(d) <= base + 2 + by.pages, timeout=5), f"the daemon keeps {daemon_fds(d) - base} fds"
    with d.client() as c, c.open_session("after-flood") as x:  # new pages and a new channel still possible
        x.free(x.allocate(16))
        assert_books(c.stats())
    s.close()
    os.close(r)
    os.close(w)
    by.stop()


def test_hog_at_its_maximum_ignoring_reclaim_is_bounded_by_max_bytes(daemon_factory):
    """The daemon cannot take pages by force; max_bytes is what bounds a
    tenant that ignores reclaim. The hog holds its maximum (half the budget)
    and never answers: beyond it, RESOURCE_EXHAUSTED naming max_bytes; the
    others get the other half; a waiting Allocate for more fails precisely
    after its wait, naming the hog, and the hog is counted as an ignorer."""
    d = daemon_factory("host", memory_limit="64MiB", reclaim_timeout_ms="200")  # 32 pages
    with d.client() as c:
        hog_s = c.open_session("hog", max_bytes=32 << 20)
        held = hog_s.allocate(16)
        with pytest.raises(errors.ResourceExhausted, match=r"holds 16 pages on HOST-0; 1 more would exceed its maximum of 16 pages \(max_bytes 32 MiB\)"):
            hog_s.allocate(1)
        other = c.open_session("other")
        mine = other.allocate(16, wait=True, wait_timeout_ms=500)
        t0 = time.monotonic()
        with pytest.raises(errors.ResourceExhausted, match=r"after waiting 0.5 s, still 4 pages short.*session %d 'hog' 4 pages \(gave back 0" % hog_s.id):
            other.allocate(4, wait=True, wait_timeout_ms=500)
        assert 0.45 < time.monotonic() - t0 < 3
        admin = c.open_session("admin")
        assert wait_until(lambda: {s.name: s for s in admin.stats().sessions}["hog"].reclaim_ignored >= 1, timeout=3)
        other.free(mine)
        hog_s.free(held)
        assert_books(c.stats())
        for s in (hog_s, other, admin):
            s.close()


def test_huge_messages(daemon_factory, tmp_path):
    """Messages at and beyond gRPC's 4 MiB limit: under it, precise errors
    after validation that takes well under a second; over it,
    RESOURCE_EXHAUSTED from gRPC for every method; the daemon's memory does
    not balloon and it keeps serving."""
    d = daemon_factory("host", state_dir=str(tmp_path / "state"), grpc_page_ops=True)
    by = Bystander(d).settled()
    with d.client() as c, c.open_session("big") as s:
        rpc = stub(c)
        held = s.allocate(1)
        rss0 = daemon_rss(d)

        def expect(fn, code, fragment):
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                fn()
            took = time.monotonic() - t0
            assert info.value.code() == code, (info.value.code(), info.value.details()[:300])
            assert fragment in info.value.details(), info.value.details()[:300]
            return took

        many = list(range(10**6, 10**6 + 900_000))  # 3-byte varints: ~2.7 MB
        t_free = expect(lambda: rpc.Free(pb.FreeRequest(session=ref(s), page_ids=many), timeout=20), C.NOT_FOUND, f"page {10**6} is not held")
        same = [held[0].id] * 900_000
        t_dup = expect(lambda: rpc.Free(pb.FreeRequest(session=ref(s), page_ids=same), timeout=20), C.INVALID_ARGUMENT, "appears more than once")
        expect(lambda: rpc.OpenSession(pb.OpenSessionRequest(channel_secret=b"s" * 32, name="n" * (3 << 20)), timeout=20), C.INVALID_ARGUMENT, "session name must be 1-128")
        labels = {f"k{i}": "v" * 100 for i in range(30_000)}  # ~3.5 MB
        ch = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ch.connect(d.fd_socket)
        secret = fdchannel.recv_record(ch).secret
        expect(lambda: rpc.OpenSession(pb.OpenSessionRequest(channel_secret=secret, name="x", labels=labels), timeout=20), C.INVALID_ARGUMENT, "at most 16 labels")
        expect(lambda: rpc.ResumeSession(pb.ResumeSessionRequest(channel_secret=secret, session_id=77, page_ids=many), timeout=20), C.NOT_FOUND, "no session 77 to resume")
        ch.close()
        grpc_ch = grpc.insecure_channel(f"unix:{d.socket}")
        for m in pb.DESCRIPTOR.services_by_name["KVCached"].methods:
            path = f"/kvcached.v1.KVCached/{m.name}"
            call = grpc_ch.unary_stream(path) if m.server_streaming else grpc_ch.unary_unary(path)
            expect(lambda: list(call(b"\x0a" + b"\xff" * (5 << 20), timeout=20)) if m.server_streaming else call(b"\x0a" + b"\xff" * (5 << 20), timeout=20),
                   C.RESOURCE_EXHAUSTED, "")
        # a 1 MiB header: refused by gRPC (on either side), the daemon carries on
        with pytest.raises(grpc.RpcError):
            rpc.GetInfo(pb.GetInfoRequest(), metadata=[("x-big", "a" * (1 << 20))], timeout=10)
        grpc_ch.close()
        s.free(held)
        grown = daemon_rss(d) - rss0
        print(f"\nhuge messages: Free of 900k unknown ids {t_free * 1000:.0f} ms, of 900k repeats {t_dup * 1000:.0f} ms; daemon RSS +{grown >> 20} MiB")
        assert t_free < 2 and t_dup < 2
        assert grown < 200 << 20, f"daemon RSS grew by {grown >> 20} MiB"
        assert_books(c.stats())
    by.stop()


# ---- the control (gRPC) socket ------------------------------------------------
def flood(d, n: int, seconds: float, env: dict) -> subprocess.Popen:
    return subprocess.Popen([PY, str(HELPERS / "flood.py"), str(n), str(seconds)], env=dict(d.client_env(), **env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_control_connection_flood_from_another_uid(daemon_factory):
    """Two `nobody` processes open 21,000 control connections that never
    call (more than the daemon's 20,000 open files) while root's bystander
    allocates over its fd channel and new root clients keep connecting,
    opening sessions and allocating: nobody holds at most
    max_grpc_connections_per_uid (256) of them, the rest are closed at once
    (counted and logged); the ones it holds are closed after
    grpc_idle_timeout; the daemon's open files stay bounded; every
    bystander call succeeds."""
    from test_metrics import scrape, value

    d = daemon_factory("host", shared_dir=True, socket_mode="0666", grpc_idle_timeout="15",
                       metrics_address="127.0.0.1:0")
    by = Bystander(d).settled()
    base = daemon_fds(d)
    peak = [base]
    newcomers: list[float] = []
    failures: list[str] = []
    stop = threading.Event()

    def watch_fds():
        while not stop.is_set():
            peak[0] = max(peak[0], daemon_fds(d))
            time.sleep(0.05)

    def newcomer():  # a new client of root, from scratch, again and again
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                with d.client(timeout=20) as c, c.open_session("newcomer") as s:
                    s.free(s.allocate(1))
                newcomers.append(time.monotonic() - t0)
            except Exception as exc:  # noqa: BLE001
                failures.append(f"{type(exc).__name__}: {exc}")
            time.sleep(0.05)

    threads = [threading.Thread(target=watch_fds, daemon=True), threading.Thread(target=newcomer, daemon=True)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    floods = [flood(d, 10_500, 40, AS_NOBODY) for _ in range(2)]
    results = []
    for f in floods:
        out, err = f.communicate(timeout=240)
        assert f.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    took = time.monotonic() - t0
    stop.set()
    for t in threads:
        t.join(30)
    by.stop()
    total = {k: sum(r[k] for r in results) for k in ("connected", "refused", "closed_early", "held", "closed_later")}
    print(f"\ncontrol flood as nobody: {total} in {took:.1f} s; daemon fds: base {base}, peak {peak[0]}; "
          f"root newcomers {len(newcomers)} (worst {max(newcomers, default=0):.2f} s); bystander {by.rounds} rounds, "
          f"worst {by.worst * 1000:.0f} ms; first idle close after {[r['first_close_after'] for r in results]} s")
    assert not failures, failures[:5]
    assert len(newcomers) >= 5, newcomers
    assert total["connected"] == 21_000, total  # every connect() got through the door, and most were shown out
    assert total["held"] <= 256, total  # max_grpc_connections_per_uid, both processes together
    assert total["closed_later"] == total["held"], total  # held ones: closed after the idle timeout
    assert all(r["first_close_after"] is None or r["first_close_after"] >= 12 for r in results), results  # 15 s, grpc's jitter
    # the daemon's files: at most 256 relayed connections (3 fds each: the client's, the relay's, grpcio's),
    # 64 refusals being answered, and the connections accepted but not yet admitted or closed (asyncio
    # accepts up to 100 per wake-up and closes refused ones on its next turn); far from the 20,000 limit
    assert peak[0] <= base + 3 * 256 + 64 + 400, f"daemon fds peaked at {peak[0]} (base {base})"
    text = scrape(d)
    refused = value(text, "kvcached_control_connections_refused_total", limit="per_uid")
    assert refused >= total["closed_early"], (refused, total)
    log = d.log_text()
    assert "refused a control connection from pid" in log and f"uid {NOBODY.pw_uid} already has 256 control connections open (max_grpc_connections_per_uid=256)" in log
    assert wait_until(lambda: daemon_fds(d) <= base + 8, timeout=10), f"{daemon_fds(d) - base} fds left after the flood"


def test_control_connection_limits_answer_precisely(daemon_factory):
    """A gRPC client over a limit gets RESOURCE_EXHAUSTED naming it (per uid,
    then in total); another uid is not refused for the first uid's
    connections; a slot freed is usable again."""
    from test_metrics import scrape, value

    d = daemon_factory("host", shared_dir=True, socket_mode="0666", max_grpc_connections="6", max_grpc_connections_per_uid="4",
                       grpc_admin_reserve="0", metrics_address="127.0.0.1:0")
    # the start-up health check's connection is gone
    assert wait_until(lambda: value(scrape(d), "kvcached_control_connections") == 0, timeout=5)
    opts = [("grpc.use_local_subchannel_pool", 1)]  # one connection per channel
    chans = [grpc.insecure_channel(f"unix:{d.socket}", options=opts) for _ in range(5)]
    codes = []
    for ch in chans:
        try:
            pb_grpc.KVCachedStub(ch).GetInfo(pb.GetInfoRequest(), timeout=10)
            codes.append("OK")
        except grpc.RpcError as exc:
            codes.append((exc.code().name, exc.details()))
    assert codes[:4] == ["OK"] * 4, codes
    assert codes[4] == ("RESOURCE_EXHAUSTED", "kvcached: uid 0 already has 4 control connections open (max_grpc_connections_per_uid=4)"), codes
    # the uid `daemon` is not refused for root's four: 2 slots left in total
    other = subprocess.run([PY, str(HELPERS / "hostile.py"), "getinfo", "3"], env=dict(d.client_env(), **AS_DAEMON),
                           capture_output=True, text=True, timeout=60)
    res = json.loads(other.stdout.strip().splitlines()[-1])
    assert res["codes"][:2] == ["OK", "OK"], res
    assert res["codes"][2] == ["RESOURCE_EXHAUSTED", "kvcached: the daemon already has 6 control connections open (max_grpc_connections=6)"], res
    chans[0].close()  # a slot comes back
    assert wait_until(lambda: _getinfo_ok(d, opts), timeout=5)
    for ch in chans[1:]:
        ch.close()


def _getinfo_ok(d, opts) -> bool:
    with grpc.insecure_channel(f"unix:{d.socket}", options=opts) as ch:
        try:
            pb_grpc.KVCachedStub(ch).GetInfo(pb.GetInfoRequest(), timeout=5)
            return True
        except grpc.RpcError:
            return False


def test_a_client_that_never_reads_its_replies_loses_its_session(daemon_factory):
    """Issue 28: a client sends requests on its fd channel and never reads a
    reply. Before, the daemon queued the replies for ever (a Task each,
    waiting for room), dropped them after fd_send_timeout without a word,
    and the session never ended (835,882 of 880,530 replies dropped, RSS
    208 -> 501 MiB in 60 s). Now: past MAX_WAITING_SENDS waiting records (or
    fd_send_timeout without room) the session ends with a logged reason and
    its pages come back. Deaf clients come back again and again for
    KVCACHED_DEAF_SECONDS (default 15; 60 by hand): each session ends within
    6 s, the daemon's RSS grows by less than 20 MiB, a bystander is served
    throughout."""
    from kvcached_service.server.transports.channel import MAX_WAITING_SENDS

    seconds = float(os.environ.get("KVCACHED_DEAF_SECONDS", "15"))
    d = daemon_factory("host", memory_limit="256MiB", log_level="WARNING")
    stub = pb_grpc.KVCachedStub(grpc.insecure_channel(f"unix:{d.socket}"))
    by = Bystander(d).settled()
    rss0 = daemon_rss(d)
    ended, sent_total, rounds = [], 0, 0
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        try:
            sock, ref = _raw_session(d, stub, f"deaf-{rounds}")
        except OSError as exc:
            raise AssertionError(f"round {rounds}: {exc}\n" + d.log_text()[-3000:]) from exc
        rounds += 1
        sock.setblocking(False)
        fdchannel.send_record(sock, fdchannel.encode_allocate(1, 4))  # it holds pages: they must come back
        t0 = time.monotonic()
        req = 2
        while True:  # FREE of a page it does not hold: a REPLY each, never read
            try:
                fdchannel.send_record(sock, fdchannel.encode_free(req, [1 << 40]))
                req += 1
            except BlockingIOError:
                time.sleep(0.001)
            except OSError:  # the daemon closed the channel: the session ended
                break
            if time.monotonic() - t0 > 10:
                raise AssertionError(f"session {ref.session_id} still open after 10 s of unread replies")
        ended.append(time.monotonic() - t0)
        sent_total += req - 2
        sock.close()
    rss = daemon_rss(d)
    st = stub.GetStats(pb.GetStatsRequest(), timeout=10)
    print(f"\n{rounds} deaf sessions in {seconds:g} s: {sent_total} requests sent, each session ended after "
          f"{min(ended):.2f}-{max(ended):.2f} s; daemon RSS {rss0 / 2**20:.0f} -> {rss / 2**20:.0f} MiB; "
          f"bystander {by.rounds} rounds, worst {by.worst * 1000:.0f} ms")
    assert max(ended) < 6
    assert rss - rss0 < 20 * 2**20
    assert wait_until(lambda: stub.GetStats(pb.GetStatsRequest(), timeout=10).sessions_open == 1, timeout=5)  # the bystander
    assert by.failures == [] and by.worst < 1.0
    by.stop()
    with d.client() as c:
        st = c.stats()
        assert st.total.pages_in_use == 0
        assert_books(st)
    log = d.log_text()
    assert f"records wait for room; ending its session" in log or "did not read its fd channel" in log, log[-2000:]
    assert MAX_WAITING_SENDS <= 1024


def test_a_full_channel_without_new_requests_ends_after_fd_send_timeout(daemon_factory):
    """The other way to stop reading: the replies fill the channel with
    fewer than MAX_WAITING_SENDS waiting, then the client sends nothing more.
    The replies wait for room fd_send_timeout (1 s here), then the session
    ends and its pages come back. (How many replies a socket holds depends
    on the kernel's buffers: a first deaf session measures it, as the
    requests sent before the bound ended it, minus the bound.)"""
    from kvcached_service.server.transports.channel import MAX_WAITING_SENDS

    d = daemon_factory("host", fd_send_timeout="1", log_level="WARNING")
    stub = pb_grpc.KVCachedStub(grpc.insecure_channel(f"unix:{d.socket}"))

    def deaf(name, limit=None):
        sock, ref = _raw_session(d, stub, name)
        fdchannel.send_record(sock, fdchannel.encode_allocate(1, 2))
        sent = 0
        while limit is None or sent < limit:
            try:
                fdchannel.send_record(sock, fdchannel.encode_free(2 + sent, [1 << 40]))
            except OSError:
                break  # the daemon ended the session
            sent += 1
            time.sleep(0.002)  # served one by one: the replies wait in order
        return sock, sent

    sock, sent = deaf("measures")
    sock.close()
    holds = sent - MAX_WAITING_SENDS
    assert holds > 10, sent
    assert wait_until(lambda: stub.GetStats(pb.GetStatsRequest(), timeout=10).sessions_open == 0, timeout=5)
    sock, sent = deaf("stops-reading", limit=holds + MAX_WAITING_SENDS // 2)
    t0 = time.monotonic()
    assert stub.GetStats(pb.GetStatsRequest(), timeout=10).sessions_open == 1
    assert wait_until(lambda: stub.GetStats(pb.GetStatsRequest(), timeout=10).sessions_open == 0, timeout=6)
    took = time.monotonic() - t0
    print(f"\nthe socket holds ~{holds} replies; {sent} requests sent, the session ended {took:.2f} s after the last")
    assert took < 3
    assert stub.GetStats(pb.GetStatsRequest(), timeout=10).total.pages_in_use == 0
    assert "did not read its fd channel for 1 s; ending its session" in d.log_text(), d.log_text()[-2000:]
    sock.close()


def test_unprivileged_uids_cannot_lock_operators_out_of_the_control_socket(daemon_factory):
    """Issue 28: uids that are not admins filled the 1,024 connections
    (4 x 256), then root was refused too, and so was `kvcachedctl health`,
    the liveness probe (kubelet would restart the daemon, ending every
    session); a Health.Watch kept each connection from idling out. Now
    grpc_admin_reserve slots are for admin uids and the daemon's own uid
    only. Here max 48, per uid 20, reserve 8: two uids hold 20 each with a
    Health.Watch on every connection, a third is refused naming the limit
    (without the reserve it took the last 8 and root was refused);
    root's health check and GetStats answer within 100 ms, and
    `kvcachedctl health` exits 0."""
    import pwd

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    third = pwd.getpwnam("bin")
    d = daemon_factory("host", shared_dir=True, socket_mode="0666", max_grpc_connections="48",
                       max_grpc_connections_per_uid="20", grpc_admin_reserve="8", log_level="WARNING")
    holders = []
    try:
        for env in (AS_NOBODY, AS_DAEMON):
            p = subprocess.Popen([PY, str(HELPERS / "hostile.py"), "hold", "25"], env=dict(d.client_env(), **env),
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            holders.append(p)
            res = json.loads(p.stdout.readline())
            assert res["codes"][:20] == ["OK"] * 20 and all(c != "OK" for c in res["codes"][20:]), res
        p = subprocess.Popen([PY, str(HELPERS / "hostile.py"), "hold", "10"],
                             env=dict(d.client_env(), KVCACHED_TEST_AS_UID=f"{third.pw_uid}:{third.pw_gid}"),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        holders.append(p)
        res = json.loads(p.stdout.readline())  # without the reserve it took the last 8 slots: root was refused
        assert res["codes"][0] == ["RESOURCE_EXHAUSTED", "kvcached: the daemon already has 40 control connections of non-admin uids "
                                   "open (max_grpc_connections=48 less grpc_admin_reserve=8)"], res
        assert "OK" not in res["codes"], res
        opts = [("grpc.use_local_subchannel_pool", 1)]
        for _ in range(3):
            with grpc.insecure_channel(f"unix:{d.socket}", options=opts) as ch:
                t0 = time.monotonic()
                h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                t_health = time.monotonic() - t0
                t0 = time.monotonic()
                pb_grpc.KVCachedStub(ch).GetStats(pb.GetStatsRequest(), timeout=5)
                t_stats = time.monotonic() - t0
            print(f"\nroot with 40 non-admin connections held: health {t_health * 1000:.1f} ms, GetStats {t_stats * 1000:.1f} ms")
            assert h.status == health_pb2.HealthCheckResponse.SERVING
            assert t_health < 0.1 and t_stats < 0.1
        ctl = subprocess.run([str(ROOT / ".venv/bin/kvcachedctl"), "--socket", d.socket, "health"], capture_output=True, text=True, timeout=30)
        assert ctl.returncode == 0, ctl.stdout + ctl.stderr
    finally:
        for p in holders:
            p.stdin.close()
            p.wait(30)


def test_health_watch_streams_are_capped_per_uid(daemon_factory):
    """A Health.Watch is a call in flight for as long as the client likes, so
    its connection never idles out. A uid that is not an admin may hold
    max_health_watches_per_uid (3 here) at once; the next is refused naming
    the limit and pointing at Health.Check; root is not capped; the watches
    end with their process and the uid gets its 3 again."""
    d = daemon_factory("host", shared_dir=True, socket_mode="0666", max_health_watches_per_uid="3")
    for _ in range(2):
        r = subprocess.run([PY, str(HELPERS / "hostile.py"), "watches", "5"], env=dict(d.client_env(), **AS_NOBODY),
                           capture_output=True, text=True, timeout=60)
        res = json.loads(r.stdout.strip().splitlines()[-1])
        assert res["codes"][:3] == ["SERVING"] * 3, res
        assert res["codes"][3:] == [["RESOURCE_EXHAUSTED", f"kvcached: uid {NOBODY.pw_uid} already has 3 Health.Watch streams open "
                                     "(max_health_watches_per_uid=3); use Health.Check to poll"]] * 2, res
    r = subprocess.run([PY, str(HELPERS / "hostile.py"), "watches", "5"], env=d.client_env(), capture_output=True, text=True, timeout=60)
    assert json.loads(r.stdout.strip().splitlines()[-1])["codes"] == ["SERVING"] * 5  # root: an admin
