"""A scriptable fake daemon end, for the client-semantics scenarios.

    python tests/helpers/fakedaemon.py --socket PATH --scenario tests/scenarios/NAME.json

It serves the two sockets a client expects (gRPC on PATH, the fd channel on
PATH.fd) and plays the scenario's `daemon.script`, one step after another,
against whatever client connects: Python (tests/test_scenarios.py), Go or
C (later: they start this program as a subprocess the same way). The client
side of a scenario (`client`) is run by each client's own test harness.

Protocol with the harness:
- stdout: one JSON line {"ready": true, "socket": PATH} once both sockets
  listen; at the end one JSON line {"ok": true} or {"ok": false, "step": N,
  "error": "..."}; exit status 0 or 1.
- stdin: lines "signal NAME" (a client step reached a point the script
  waits for: `wait_signal`); end of input is fine.

gRPC (answered at once, and recorded for `expect_rpc`): GetInfo (one host
device, FAKE-0, page_size from the scenario), OpenSession (the secret must
be the current channel's), ResumeSession, GetStats (no sessions), Watch
(READY, then nothing). Page descriptors the fake sends are memfds of
page_size bytes holding "kvc-fake page <id>" at offset 0, so a client can
check which page it mapped, and the fake can check what comes back in ADOPT.

Script steps ({"do": ...}); `$name.field` in a value refers to a record
bound earlier with "as" (`$a.alloc` is $a.req_id | 2^63):
  accept [hello=true]          wait for a channel connection, send HELLO
  expect record=T [fields] [as] [timeout]   the next record from the client is T with these fields
  expect_eof [timeout]         the client closed the channel
  expect_nothing seconds       no record, no EOF, for that long
  expect_no_connection seconds nobody connects a new channel for that long
  expect_rpc rpc=NAME [fields] the next OpenSession/ResumeSession/CloseSession call, with these fields
  send record=T [fields]       PAGES (page_ids; fds made here), REPLY, ERROR, GOODBYE, HELLO
  send_raw hex [fds]           exact bytes (a malformed record), with fds memfds attached
  send_vector name             a record of protos/kvcached/v1/fdchannel.vectors.json, with its fds
  hangup                       close the channel without a word (the daemon died)
  sleep seconds
  wait_signal name [timeout]   wait for "signal NAME" on stdin
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import queue
import secrets
import socket
import sys
import threading
import time
from concurrent import futures

import grpc

from kvcached_service import fdchannel
from kvcached_service._generated.kvcached.v1 import kvcached_pb2 as pb
from kvcached_service._generated.kvcached.v1 import kvcached_pb2_grpc as pb_grpc

DEVICE = "FAKE-0"
ROOT = pathlib.Path(__file__).resolve().parents[2]
VECTORS = json.loads((ROOT / "protos" / "kvcached" / "v1" / "fdchannel.vectors.json").read_text())
DEFAULT_TIMEOUT = 10.0


class ScriptFailed(Exception):
    pass


def marker(page_id: int) -> bytes:
    return f"kvc-fake page {page_id}".encode()


class Fake(pb_grpc.KVCachedServicer):
    def __init__(self, path: str, scenario: dict):
        self.path = path
        self.fd_path = path + ".fd"
        d = scenario.get("daemon", {})
        self.page_size = int(d.get("page_size", 4096))
        self.resumable = bool(d.get("resumable", False))
        self.session_id = int(d.get("session_id", 1))
        self.rpc_errors = d.get("rpc_errors", {})  # rpc -> {"code": NAME, "message": ...}
        self.script = d.get("script", [])
        self.rpcs: queue.Queue = queue.Queue()
        self.signals: set[str] = set()
        self.signal_cond = threading.Condition()
        self.conn: socket.socket | None = None
        self.secret = b""
        self.vars: dict[str, dict] = {}
        self.stop = threading.Event()

    # ---- gRPC ----------------------------------------------------------
    def _fail_if_scripted(self, rpc: str, context) -> None:
        e = self.rpc_errors.get(rpc)
        if e:
            context.abort(getattr(grpc.StatusCode, e["code"]), e.get("message", ""))

    def GetInfo(self, request, context):
        return pb.GetInfoResponse(
            version="fake", api_version=1, fd_socket=self.fd_path, fd_protocol_version=fdchannel.VERSION, backend="host",
            devices=[pb.DeviceInfo(uuid=DEVICE, name="fake device", kind="host", page_size=self.page_size, granularity=4096,
                                   total_bytes=1 << 30, budget_bytes=1 << 28)],
            max_pages_per_request=65536, fd_channel_requests=True, fd_channel_requests_only=True, fd_channel_keep_handles=True)

    def OpenSession(self, request, context):
        self.rpcs.put(("OpenSession", request))
        self._fail_if_scripted("OpenSession", context)
        if request.channel_secret != self.secret:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "unknown or already used channel secret")
        return pb.OpenSessionResponse(session=pb.SessionRef(id=self.session_id, token=secrets.token_bytes(32)), pid=os.getpid(),
                                      uid=os.getuid(), gid=os.getgid(), admin=False,
                                      resume_token=secrets.token_bytes(32) if self.resumable else b"")

    def ResumeSession(self, request, context):
        self.rpcs.put(("ResumeSession", request))
        self._fail_if_scripted("ResumeSession", context)
        if request.channel_secret != self.secret:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "unknown or already used channel secret")
        return pb.ResumeSessionResponse(session=pb.SessionRef(id=request.session_id, token=secrets.token_bytes(32)),
                                        pages_adopted=len(request.page_ids), pages_forgotten=0)

    def CloseSession(self, request, context):
        self.rpcs.put(("CloseSession", request))
        return pb.CloseSessionResponse(pages_returned=0)

    def GetStats(self, request, context):
        return pb.GetStatsResponse()

    def Watch(self, request, context):
        yield pb.WatchEvent(kind=pb.WatchEvent.READY, time_unix=time.time())
        while not self.stop.wait(0.2) and context.is_active():
            pass

    # ---- the fd channel ---------------------------------------------------
    def value(self, v):
        """Resolve "$name.field" references."""
        if isinstance(v, str) and v.startswith("$"):
            name, _, field = v[1:].partition(".")
            rec = self.vars[name]
            if field == "alloc":
                return int(rec["req_id"]) | fdchannel.CHANNEL_ALLOC_BIT
            return rec[field]
        if isinstance(v, list):
            return [self.value(x) for x in v]
        return v

    def recv(self, timeout: float):
        assert self.conn is not None, "no channel: the script must `accept` first"
        self.conn.settimeout(timeout)
        try:
            return fdchannel.recv_record(self.conn, fdchannel.MAX_CLIENT_RECORD)
        except socket.timeout:
            raise ScriptFailed(f"nothing from the client within {timeout:g} s") from None

    def make_pages(self, ids: list[int]) -> list[int]:
        fds = []
        for pid in ids:
            fd = os.memfd_create(f"kvc-fake-{pid}", os.MFD_CLOEXEC)
            os.ftruncate(fd, self.page_size)
            os.pwrite(fd, marker(pid), 0)
            fds.append(fd)
        return fds

    def step(self, st: dict) -> None:
        do = st["do"]
        timeout = float(st.get("timeout", DEFAULT_TIMEOUT))
        if do == "accept":
            self.lsock.settimeout(timeout)
            try:
                conn, _ = self.lsock.accept()
            except socket.timeout:
                raise ScriptFailed(f"no fd channel connection within {timeout:g} s") from None
            if self.conn is not None:
                self.conn.close()
            self.conn = conn
            if st.get("hello", True):
                self.secret = secrets.token_bytes(fdchannel.SECRET_SIZE)
                fdchannel.send_record(conn, fdchannel.encode_hello(fdchannel.Hello(1, os.getpid(), os.getuid(), os.getgid(), fdchannel.MAX_FDS, self.secret)))
        elif do == "expect":
            rec = self.recv(timeout)
            got = type(rec).__name__ if rec is not None else "end of stream"
            want = {"ALLOCATE": fdchannel.AllocateReq, "FREE": fdchannel.FreeReq, "CLOSE": fdchannel.CloseReq, "ADOPT": fdchannel.Adopt,
                    "DROPPED": fdchannel.DroppedReq}[st["record"]]
            if not isinstance(rec, want):
                raise ScriptFailed(f"expected {st['record']}, got {got}: {rec!r}")
            fields = {"req_id": getattr(rec, "req_id", 0)}
            if isinstance(rec, fdchannel.AllocateReq):
                fields.update(num_pages=rec.num_pages, device=rec.device, wait=rec.wait, notify=rec.notify)
            if isinstance(rec, (fdchannel.FreeReq, fdchannel.Adopt, fdchannel.DroppedReq)):
                fields["page_ids"] = sorted(rec.page_ids)
            if isinstance(rec, fdchannel.FreeReq):
                fields["keep"] = rec.keep
            if isinstance(rec, fdchannel.Adopt):
                fields["session_id"] = rec.session_id
                for pid, fd in zip(rec.page_ids, rec.fds):  # the descriptor is the page it names
                    head = os.pread(fd, len(marker(pid)), 0)
                    if head != marker(pid):
                        raise ScriptFailed(f"ADOPT: the fd sent for page {pid} holds {head!r}")
                fdchannel.close_fds(rec.fds)
            for k, v in st.items():
                if k in ("do", "record", "as", "timeout"):
                    continue
                v = self.value(v)
                if k == "page_ids":
                    v = sorted(v)
                if fields.get(k) != v:
                    raise ScriptFailed(f"{st['record']}: {k} is {fields.get(k)!r}, expected {v!r}")
            if "as" in st:
                self.vars[st["as"]] = fields
        elif do == "expect_eof":
            try:
                rec = self.recv(timeout)
            except OSError:
                rec = None
            if rec is not None:
                raise ScriptFailed(f"expected the client to close the channel, got {rec!r}")
        elif do == "expect_nothing":
            try:
                rec = self.recv(float(st["seconds"]))
            except ScriptFailed:
                return  # nothing: as expected
            raise ScriptFailed(f"expected nothing for {st['seconds']} s, got {rec!r}")
        elif do == "expect_no_connection":
            self.lsock.settimeout(float(st["seconds"]))
            try:
                conn, _ = self.lsock.accept()
            except socket.timeout:
                return
            conn.close()
            raise ScriptFailed(f"the client connected a new fd channel within {st['seconds']} s")
        elif do == "expect_rpc":
            try:
                name, req = self.rpcs.get(timeout=timeout)
            except queue.Empty:
                raise ScriptFailed(f"no {st['rpc']} call within {timeout:g} s") from None
            if name != st["rpc"]:
                raise ScriptFailed(f"expected a {st['rpc']} call, got {name}")
            for k, v in st.items():
                if k in ("do", "rpc", "timeout"):
                    continue
                got = getattr(req, k)
                got = sorted(got) if k == "page_ids" else got
                v = sorted(self.value(v)) if k == "page_ids" else self.value(v)
                if got != v:
                    raise ScriptFailed(f"{name}: {k} is {got!r}, expected {v!r}")
        elif do == "send":
            self.send(st)
        elif do == "send_vector":
            v = next((x for x in VECTORS["vectors"] + VECTORS["unexpected"] if x["name"] == st["name"]), None)
            if v is None:
                raise ScriptFailed(f"no vector {st['name']!r}")
            self.step({"do": "send_raw", "hex": v["hex"], "fds": v["fds"]})
        elif do == "send_raw":
            fds = self.make_pages(list(range(900, 900 + int(st.get("fds", 0)))))
            fdchannel.send_record(self.conn, bytes.fromhex(st["hex"]), fds)
            fdchannel.close_fds(fds)
        elif do == "hangup":
            if self.conn is not None:
                self.conn.close()
                self.conn = None
        elif do == "sleep":
            time.sleep(float(st["seconds"]))
        elif do == "wait_signal":
            with self.signal_cond:
                if not self.signal_cond.wait_for(lambda: st["name"] in self.signals, timeout):
                    raise ScriptFailed(f"no signal {st['name']!r} within {timeout:g} s")
        else:
            raise ScriptFailed(f"unknown step {do!r}")

    def send(self, st: dict) -> None:
        kind = st["record"]
        v = {k: self.value(x) for k, x in st.items()}
        fds: list[int] = []
        if kind == "PAGES":
            ids = [int(i) for i in v["page_ids"]]
            data = fdchannel.encode_pages(int(v["allocation_id"]), int(v.get("first_index", 0)), int(v.get("total", len(ids))), ids)
            fds = self.make_pages(ids)
        elif kind == "REPLY":
            data = fdchannel.encode_reply(int(v["req_id"]), int(v.get("code", 0)), int(v.get("value", 0)), v.get("message", ""))
        elif kind == "ERROR":
            data = fdchannel.encode_error(int(v["code"]), v.get("message", ""))
        elif kind == "GOODBYE":
            data = fdchannel.encode_goodbye()
        elif kind == "DROP":
            data = fdchannel.encode_drop([int(i) for i in v["page_ids"]])
        elif kind == "HELLO":
            data = fdchannel.encode_hello(fdchannel.Hello(1, 1, 0, 0, fdchannel.MAX_FDS, bytes(32)))
        else:
            raise ScriptFailed(f"the fake does not send {kind}")
        try:
            fdchannel.send_record(self.conn, data, fds)
        except (BrokenPipeError, ConnectionResetError):
            # GOODBYE and ERROR are best effort, as in the daemon: a client may
            # close the channel as soon as it has CLOSE's REPLY
            if kind not in ("GOODBYE", "ERROR"):
                raise
        finally:
            fdchannel.close_fds(fds)

    # ---- running -------------------------------------------------------------
    def read_signals(self) -> None:
        for line in sys.stdin:
            words = line.split()
            if len(words) == 2 and words[0] == "signal":
                with self.signal_cond:
                    self.signals.add(words[1])
                    self.signal_cond.notify_all()

    def run(self) -> int:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        pb_grpc.add_KVCachedServicer_to_server(self, server)
        server.add_insecure_port(f"unix:{self.path}")
        server.start()
        self.lsock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.lsock.bind(self.fd_path)
        self.lsock.listen(8)
        threading.Thread(target=self.read_signals, daemon=True).start()
        print(json.dumps({"ready": True, "socket": self.path}), flush=True)
        result: dict = {"ok": True}
        for i, st in enumerate(self.script):
            try:
                self.step(st)
            except (ScriptFailed, OSError, KeyError, AssertionError) as exc:
                result = {"ok": False, "step": i, "do": st, "error": f"{type(exc).__name__}: {exc}"}
                break
        self.stop.set()
        if self.conn is not None:
            self.conn.close()
        self.lsock.close()
        server.stop(0.5)
        for p in (self.path, self.fd_path):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        print(json.dumps(result), flush=True)
        return 0 if result["ok"] else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", required=True)
    ap.add_argument("--scenario", required=True)
    ns = ap.parse_args()
    with open(ns.scenario) as f:
        scenario = json.load(f)
    return Fake(ns.socket, scenario).run()


if __name__ == "__main__":
    sys.exit(main())
