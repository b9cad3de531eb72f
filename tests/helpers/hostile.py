"""Tenants for tests/test_hostile.py: `hostile.py MODE [args]`; each prints
JSON lines. KVCACHED_TEST_AS_UID=uid:gid makes it another user first (after
every import, like client_proc.py).

  connect                  raw connect() to the control and fd sockets; report errno
  victim N BYTE            allocate N pages, fill them entirely with BYTE, print
                           ids and the SessionRef (the "stolen" token); on each
                           stdin line report whether the bytes are intact
  stolen ID TOKEN_HEX IDS  an attacker holding a stolen SessionRef: try every rpc
                           with it, watch its own fd channel for pages, report codes
  own IDS VICTIM_SESSION   an attacker with its own session: free/see/limit the
                           victim's pages and session; report codes
  grab N TIMEOUT           allocate N pages as soon as they can be had (retrying);
                           report whether every byte of every page is zero
  getinfo N                N control connections held at once, GetInfo on each; report codes
  watches N                N Health.Watch streams on one connection; report each one's first answer
  hold N                   as getinfo, then keep the connections (a Health.Watch on each, so none
                           is idle) until stdin closes
  opensecret SECRET_HEX    OpenSession with another process's channel secret; report the code
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import time


def out(**kw):
    print(json.dumps(kw), flush=True)


def drop_privileges() -> None:
    spec = os.environ.get("KVCACHED_TEST_AS_UID")
    if spec:
        import mmap  # noqa: F401
        import kvcached_service.client.region  # noqa: F401

        uid, gid = (int(x) for x in spec.split(":"))
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)


import grpc  # noqa: E402

from kvcached_service import fdchannel  # noqa: E402
from kvcached_service._generated.kvcached.v1 import kvcached_pb2 as pb  # noqa: E402
from kvcached_service._generated.kvcached.v1 import kvcached_pb2_grpc as pb_grpc  # noqa: E402
from kvcached_service.client import Client  # noqa: E402
from kvcached_service.errors import KVCachedError  # noqa: E402
from raw import ref, stub  # noqa: E402


def code_of(fn):
    try:
        r = fn()
        return "OK", r
    except grpc.RpcError as exc:
        return exc.code().name, exc.details()


def main() -> int:
    mode, args = sys.argv[1], sys.argv[2:]
    drop_privileges()
    sock = os.environ["KVCACHED_SOCKET"]
    if mode == "connect":
        res = {}
        for name, path, kind in (("control", sock, socket.SOCK_STREAM), ("fd", sock + ".fd", socket.SOCK_SEQPACKET)):
            s = socket.socket(socket.AF_UNIX, kind)
            try:
                s.connect(path)
                res[name] = "connected"
            except OSError as exc:
                res[name] = errno.errorcode.get(exc.errno, str(exc.errno))
            finally:
                s.close()
        out(**res)
        return 0
    if mode == "victim":
        n, byte = int(args[0]), int(args[1])
        c = Client.from_env()
        s = c.open_session(f"victim-{os.getpid()}")
        pages = s.allocate(n)
        for p in pages:
            p.write(0, bytes([byte]) * p.size)
        out(session=s.id, token=s.token.hex(), pages=[p.id for p in pages], pid=os.getpid(), uid=os.getuid())
        for _ in sys.stdin:
            out(intact=all(p.read() == bytes([byte]) * p.size for p in pages))
        return 0
    if mode == "stolen":
        sid, token, ids = int(args[0]), bytes.fromhex(args[1]), [int(x) for x in args[2:]]
        stolen = pb.SessionRef(id=sid, token=token)
        rpc = pb_grpc.KVCachedStub(grpc.insecure_channel(f"unix:{sock}"))
        # its own fd channel: the only place fds could ever reach it
        ch = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ch.connect(sock + ".fd")
        hello = fdchannel.recv_record(ch)
        ch.setblocking(False)
        res = {}
        code, st = code_of(lambda: rpc.GetStats(pb.GetStatsRequest(session=stolen), timeout=10))
        res["GetStats"] = code
        res["GetStats_saw_victim"] = code == "OK" and any(x.id == sid for x in st.sessions)
        code, r = code_of(lambda: rpc.Allocate(pb.AllocateRequest(session=stolen, num_pages=2), timeout=10))
        res["Allocate"] = code
        res["Allocate_ids"] = list(r.page_ids) if code == "OK" else []
        code, _ = code_of(lambda: next(iter(rpc.Watch(pb.WatchRequest(session=stolen), timeout=3))))
        res["Watch"] = code
        code, _ = code_of(lambda: rpc.ResumeSession(pb.ResumeSessionRequest(channel_secret=hello.secret, session_id=sid, resume_token=token), timeout=10))
        res["ResumeSession"] = code
        code, _ = code_of(lambda: rpc.Free(pb.FreeRequest(session=stolen, page_ids=ids), timeout=10))
        res["Free"] = code
        time.sleep(0.3)
        got = []
        while True:
            try:
                rec = fdchannel.recv_record(ch)
            except (BlockingIOError, fdchannel.ProtocolError):
                break
            if rec is None:
                break
            got.append(type(rec).__name__)
            fdchannel.close_fds(getattr(rec, "fds", ()))
        res["records_on_own_channel"] = got
        code, _ = code_of(lambda: rpc.CloseSession(pb.CloseSessionRequest(session=stolen), timeout=10))
        res["CloseSession"] = code
        out(**res)
        return 0
    if mode == "own":
        ids, victim_sid = [int(x) for x in args[0].split(",")], int(args[1])
        c = Client.from_env()
        s = c.open_session("attacker")
        rpc = stub(c)
        res = {"admin": s.admin}
        try:  # on its own fd channel (a FREE record): the only place the default mode takes it
            s.free_ids(ids)
            res["Free"], res["Free_msg"] = "OK", ""
        except KVCachedError as exc:
            res["Free"], res["Free_msg"] = exc.code.name, exc.message
        code, st = code_of(lambda: rpc.GetStats(pb.GetStatsRequest(session=ref(s)), timeout=10))
        res["GetStats"] = code
        res["sessions_seen"] = sorted(x.id for x in st.sessions) if code == "OK" else []
        res["SetSessionLimits"], _ = code_of(lambda: rpc.SetSessionLimits(pb.SetSessionLimitsRequest(
            admin=ref(s), session_id=victim_sid, max_bytes=1, set_fields=["max_bytes"]), timeout=10))
        res["RequestShrink"], _ = code_of(lambda: rpc.RequestShrink(pb.RequestShrinkRequest(admin=ref(s), session_id=victim_sid), timeout=10))
        res["own_session"] = s.id
        s.close()
        out(**res)
        return 0
    if mode == "sameuid":
        other_uid_sid = int(args[0])
        c = Client.from_env()
        server, runner = c.open_session("server"), c.open_session("runner")
        rpc = stub(c)
        pages = runner.allocate(3)
        res = {"admin": server.admin, "server": server.id, "runner": runner.id}
        res["sessions_seen"] = [x.id for x in server.stats().sessions]
        code, r = code_of(lambda: rpc.RequestShrink(pb.RequestShrinkRequest(admin=ref(server), session_id=runner.id, target_bytes=1 << 20), timeout=10))
        res["RequestShrink_own_uid"], res["pages_requested"] = code, (r.pages_requested if code == "OK" else None)
        res["RequestShrink_other_uid"], res["RequestShrink_other_uid_msg"] = code_of(lambda: rpc.RequestShrink(
            pb.RequestShrinkRequest(admin=ref(server), session_id=other_uid_sid), timeout=10))
        res["SetSessionLimits_own_uid"], _ = code_of(lambda: rpc.SetSessionLimits(pb.SetSessionLimitsRequest(
            admin=ref(server), session_id=runner.id, max_bytes=8 << 20, set_fields=["max_bytes"]), timeout=10))
        runner.free(pages)
        runner.close()
        server.close()
        out(**res)
        return 0
    if mode == "opensecret":
        secret = bytes.fromhex(args[0])
        code, r = code_of(lambda: stub(sock).OpenSession(pb.OpenSessionRequest(channel_secret=secret, name="thief"), timeout=10))
        out(OpenSession=code, OpenSession_msg=r if code != "OK" else "")
        return 0
    if mode == "hold":
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        n = int(args[0])
        opts = [("grpc.use_local_subchannel_pool", 1)]
        chans, codes, watches = [], [], []
        for _ in range(n):
            ch = grpc.insecure_channel(f"unix:{sock}", options=opts)
            chans.append(ch)
            code, r = code_of(lambda: pb_grpc.KVCachedStub(ch).GetInfo(pb.GetInfoRequest(), timeout=10))
            codes.append("OK" if code == "OK" else [code, r])
            if code == "OK":
                watches.append(health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest()))
        out(codes=codes)
        sys.stdin.read()
        for w in watches:
            w.cancel()
        return 0
    if mode == "watches":
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(f"unix:{sock}") as ch:
            calls, codes = [], []
            for _ in range(int(args[0])):
                call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=10)
                calls.append(call)
                try:
                    first = next(call)
                    codes.append(health_pb2.HealthCheckResponse.ServingStatus.Name(first.status))
                except grpc.RpcError as exc:
                    codes.append([exc.code().name, exc.details()])
            out(codes=codes)
            for call in calls:
                call.cancel()
        return 0
    if mode == "getinfo":
        n = int(args[0])
        opts = [("grpc.use_local_subchannel_pool", 1)]  # one connection per channel
        chans, codes = [], []
        for _ in range(n):
            ch = grpc.insecure_channel(f"unix:{sock}", options=opts)
            chans.append(ch)
            code, r = code_of(lambda: pb_grpc.KVCachedStub(ch).GetInfo(pb.GetInfoRequest(), timeout=10))
            codes.append("OK" if code == "OK" else [code, r])
        out(codes=codes)
        return 0
    if mode == "grab":
        n, timeout = int(args[0]), float(args[1])
        c = Client.from_env()
        s = c.open_session(f"grab-{os.getpid()}")
        t0 = time.monotonic()
        tries = 0
        while True:
            tries += 1
            try:
                pages = s.allocate(n)
                break
            except Exception as exc:  # noqa: BLE001 - the victim's pages are not back yet
                if time.monotonic() - t0 > timeout:
                    out(error=str(exc), tries=tries)
                    return 1
                time.sleep(0.005)
        waited = time.monotonic() - t0
        zero = bytes(pages[0].size)
        nonzero = [p.id for p in pages if p.read() != zero]
        out(pages=[p.id for p in pages], nonzero=nonzero, waited=waited, tries=tries, uid=os.getuid())
        s.free(pages)
        s.close()
        return 0
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    sys.exit(main())
