"""The fd channel against its wire spec (protos/kvcached/v1/fdchannel.spec.json)
and the shared test vectors (fdchannel.vectors.json) that the Go and C
codecs decode too:

- the codec (kvcached_service/fdchannel.py): its constants are the spec's,
  every vector decodes to its record or fails as the vector says (a
  malformed request with its req_id and the daemon's reply, or a protocol
  error), and the canonical ones re-encode to the same bytes;
- the daemon as a receiver: every malformed vector gets what the vector's
  `daemon` says: `reply` (REPLY INVALID_ARGUMENT naming the fault; the
  session goes on) or `close` (ERROR naming the problem, then the channel
  closes and its session ends); a request larger than any a client sends
  (a FREE of 16,385 ids) is answered too; a well-formed record of the wrong
  direction is dropped with its descriptors and the channel stays usable;
- the Python client as a receiver: every malformed vector, and every record
  the daemon never sends, is a protocol error that closes the channel.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading

import pytest

from kvtest import ROOT, assert_books, wait_until
from kvcached_service import errors, fdchannel
from kvcached_service.client.channel import Channel, ProtocolViolation

SPEC = json.loads((ROOT / "protos" / "kvcached" / "v1" / "fdchannel.spec.json").read_text())
VECTORS = json.loads((ROOT / "protos" / "kvcached" / "v1" / "fdchannel.vectors.json").read_text())
POSITIVE = [v for v in VECTORS["vectors"] if "record" in v]
NEGATIVE = [v for v in VECTORS["vectors"] if "error" in v]
RECORDS = {r["name"]: r for r in SPEC["records"]}


def _fake_fds(n: int) -> list[int]:
    return list(range(1000, 1000 + n))  # decode only carries them


def as_spec(rec) -> dict:
    """A decoded record in the vectors' notation (u64 as decimal strings)."""
    u = str
    if isinstance(rec, fdchannel.Hello):
        return {"type": "HELLO", "channel_id": u(rec.channel_id), "pid": rec.pid, "uid": rec.uid, "gid": rec.gid,
                "max_fds": rec.max_fds, "secret": rec.secret.hex()}
    if isinstance(rec, fdchannel.Pages):
        return {"type": "PAGES", "allocation_id": u(rec.allocation_id), "first_index": rec.first_index,
                "count": len(rec.page_ids), "total": rec.total, "page_ids": [u(i) for i in rec.page_ids]}
    if isinstance(rec, fdchannel.Adopt):
        return {"type": "ADOPT", "session_id": u(rec.session_id), "first_index": rec.first_index,
                "count": len(rec.page_ids), "total": rec.total, "page_ids": [u(i) for i in rec.page_ids]}
    if isinstance(rec, fdchannel.Error):
        return {"type": "ERROR", "code": rec.code, "message": rec.message}
    if isinstance(rec, fdchannel.Goodbye):
        return {"type": "GOODBYE"}
    if isinstance(rec, fdchannel.AllocateReq):
        return {"type": "ALLOCATE", "req_id": u(rec.req_id), "num_pages": rec.num_pages, "wait": rec.wait,
                "notify": rec.notify, "wait_timeout_ms": rec.wait_timeout_ms, "device": rec.device}
    if isinstance(rec, fdchannel.FreeReq):
        return {"type": "FREE", "req_id": u(rec.req_id), "count": len(rec.page_ids), "page_ids": [u(i) for i in rec.page_ids],
                "flags": rec.flags, "keep": rec.keep, "standby": rec.standby}
    if isinstance(rec, fdchannel.UseReq):
        return {"type": "USE", "req_id": u(rec.req_id), "count": len(rec.page_ids), "page_ids": [u(i) for i in rec.page_ids]}
    if isinstance(rec, fdchannel.DroppedReq):
        return {"type": "DROPPED", "req_id": u(rec.req_id), "count": len(rec.page_ids), "page_ids": [u(i) for i in rec.page_ids]}
    if isinstance(rec, fdchannel.Drop):
        return {"type": "DROP", "count": len(rec.page_ids), "page_ids": [u(i) for i in rec.page_ids]}
    if isinstance(rec, fdchannel.CloseReq):
        return {"type": "CLOSE", "req_id": u(rec.req_id)}
    if isinstance(rec, fdchannel.AnswerReq):
        return {"type": "ANSWER", "req_id": u(rec.req_id), "reclaim_id": u(rec.reclaim_id), "bytes_given": u(rec.bytes_given),
                "bytes_kept": u(rec.bytes_kept), "reason": rec.reason}
    if isinstance(rec, fdchannel.Reply):
        return {"type": "REPLY", "req_id": u(rec.req_id), "code": rec.code, "value": u(rec.value), "message": rec.message}
    raise AssertionError(rec)


def encode(r: dict) -> bytes:
    """The Python encoder applied to a vector's record."""
    t = r["type"]
    ids = [int(i) for i in r.get("page_ids", [])]
    if t == "HELLO":
        return fdchannel.encode_hello(fdchannel.Hello(int(r["channel_id"]), r["pid"], r["uid"], r["gid"], r["max_fds"], bytes.fromhex(r["secret"])))
    if t == "PAGES":
        return fdchannel.encode_pages(int(r["allocation_id"]), r["first_index"], r["total"], ids)
    if t == "ADOPT":
        return fdchannel.encode_adopt(int(r["session_id"]), r["first_index"], r["total"], ids)
    if t == "ERROR":
        return fdchannel.encode_error(r["code"], r["message"])
    if t == "GOODBYE":
        return fdchannel.encode_goodbye()
    if t == "ALLOCATE":
        return fdchannel.encode_allocate(int(r["req_id"]), r["num_pages"], r["device"], r["wait"], r["notify"], r["wait_timeout_ms"])
    if t in ("FREE", "DROPPED", "USE"):
        kind = {"FREE": fdchannel.REQ_FREE, "DROPPED": fdchannel.REQ_DROPPED, "USE": fdchannel.REQ_USE}[t]
        if not ids:
            return fdchannel._frame(kind, struct.pack("<QII", int(r["req_id"]), 0, 0))
        return fdchannel.encode_free(int(r["req_id"]), ids, keep=r.get("keep", False), kind=kind, standby=r.get("standby", False))
    if t == "DROP":
        return fdchannel.encode_drop(ids)
    if t == "CLOSE":
        return fdchannel.encode_close(int(r["req_id"]))
    if t == "ANSWER":
        return fdchannel.encode_answer(int(r["req_id"]), int(r["reclaim_id"]), int(r["bytes_given"]), int(r["bytes_kept"]), r["reason"])
    if t == "REPLY":
        return fdchannel.encode_reply(int(r["req_id"]), r["code"], int(r["value"]), r["message"])
    raise AssertionError(t)


# ---- the codec against the spec ------------------------------------------------
def test_constants_match_the_spec():
    h = {f["name"]: f for f in SPEC["header"]["fields"]}
    assert SPEC["header"]["size"] == fdchannel.HEADER_SIZE
    assert h["magic"]["value"] == fdchannel.MAGIC and h["version"]["value"] == fdchannel.VERSION == SPEC["version"]
    lim = SPEC["limits"]
    assert lim["max_fds"] == fdchannel.MAX_FDS
    assert lim["secret_size"] == fdchannel.SECRET_SIZE
    assert lim["max_free_ids"] == fdchannel.MAX_FREE_IDS
    assert lim["max_message"] == fdchannel.MAX_MESSAGE
    assert lim["max_reason"] == fdchannel.MAX_REASON
    assert lim["max_drop_ids"] == fdchannel.MAX_DROP_IDS == 519
    assert len(fdchannel.encode_drop(list(range(fdchannel.MAX_DROP_IDS)))) == fdchannel.MAX_RECORD  # the largest DROP fits
    assert lim["max_daemon_record"] == fdchannel.MAX_RECORD
    assert lim["max_client_record"] == fdchannel.MAX_CLIENT_RECORD
    assert int(lim["channel_alloc_bit"]) == fdchannel.CHANNEL_ALLOC_BIT
    assert SPEC["flags"]["ALLOCATE"] == {"wait": fdchannel.ALLOC_WAIT, "notify": fdchannel.ALLOC_NOTIFY}
    assert SPEC["flags"]["FREE"] == {"keep": fdchannel.FREE_KEEP, "standby": fdchannel.FREE_STANDBY}
    types = {"HELLO": fdchannel.HELLO, "PAGES": fdchannel.PAGES, "ERROR": fdchannel.ERROR, "GOODBYE": fdchannel.GOODBYE,
             "ADOPT": fdchannel.ADOPT, "ALLOCATE": fdchannel.REQ_ALLOCATE, "FREE": fdchannel.REQ_FREE,
             "CLOSE": fdchannel.REQ_CLOSE, "REPLY": fdchannel.REPLY, "ANSWER": fdchannel.REQ_ANSWER,
             "DROP": fdchannel.DROP, "DROPPED": fdchannel.REQ_DROPPED, "USE": fdchannel.REQ_USE}
    assert {n: r["type"] for n, r in RECORDS.items()} == types
    assert {types[n] for n, r in RECORDS.items() if r.get("answer_malformed")} == fdchannel.REQUESTS
    assert {v: k for k, v in types.items()} == fdchannel.NAMES
    fixed = {"HELLO": fdchannel._HELLO.size, "PAGES": fdchannel._PAGES.size, "ADOPT": fdchannel._PAGES.size,
             "ERROR": fdchannel._ERROR.size, "ALLOCATE": fdchannel._REQ_ALLOC.size, "FREE": fdchannel._REQ_FREE.size,
             "CLOSE": fdchannel._REQ_CLOSE.size, "REPLY": fdchannel._REPLY.size, "ANSWER": fdchannel._REQ_ANSWER.size,
             "DROP": fdchannel._DROP.size, "DROPPED": fdchannel._REQ_FREE.size, "USE": fdchannel._REQ_FREE.size}
    for name, size in fixed.items():
        s = RECORDS[name]["size"]
        assert s.get("exact", s.get("fixed", s.get("min"))) == size, name
    # every field of a record lies inside its fixed part, in order
    for r in SPEC["records"]:
        offs = [f["offset"] for f in r["fields"]]
        assert offs == sorted(offs), r["name"]


@pytest.mark.parametrize("v", POSITIVE, ids=lambda v: v["name"])
def test_vector_decodes(v):
    rec = fdchannel.decode(bytes.fromhex(v["hex"]), _fake_fds(v["fds"]))
    want = dict(v["record"])
    if want["type"] == "ALLOCATE":
        want.pop("flags")  # kept as wait/notify
    assert as_spec(rec) == want
    fds = getattr(rec, "fds", ())
    assert len(fds) == v["fds"]
    if v["canonical"]:
        assert encode(v["record"]).hex() == v["hex"]


@pytest.mark.parametrize("v", NEGATIVE, ids=lambda v: v["name"])
def test_vector_is_the_fault_it_says(v):
    """One behaviour: the decoder classifies each malformed vector as the
    vector says (the Go and C decoders load the same file)."""
    assert v["client"] == "close"
    with pytest.raises(fdchannel.ProtocolError) as info:
        fdchannel.decode(bytes.fromhex(v["hex"]), _fake_fds(v["fds"]))
    if v["error"] == "malformed_request":
        assert v["daemon"] == "reply"
        assert isinstance(info.value, fdchannel.MalformedRequest), info.value
        assert info.value.req_id == int(v["req_id"])
        assert v["reply"]["code"] == errors.Code.INVALID_ARGUMENT and info.value.message == v["reply"]["message"]
    else:
        assert v["error"] == "protocol" and v["daemon"] == "close"
        assert not isinstance(info.value, fdchannel.MalformedRequest), info.value


def test_every_request_type_has_both_kinds_of_fault():
    """The vectors cover, for each request type, a malformed request the
    daemon answers and one it cannot (no req_id or broken framing)."""
    for name in ("ALLOCATE", "FREE", "CLOSE", "ANSWER", "DROPPED", "USE"):
        t = RECORDS[name]["type"]
        kinds = {v["error"] for v in NEGATIVE if bytes.fromhex(v["hex"])[6:8] == t.to_bytes(2, "little")}
        assert "malformed_request" in kinds, name
    assert {v["name"] for v in NEGATIVE if v["daemon"] == "close" and v["sent_by"] == "client"} >= {
        "close_no_req_id", "allocate_no_req_id", "free_payload_len_mismatch", "allocate_bad_version", "adopt_past_total"}


def test_a_cut_request_is_answered_a_cut_anything_else_closes():
    """SOCK_SEQPACKET keeps record boundaries, so a request cut on receipt
    (bigger than max_client_record) still has its req_id: answered."""
    n = fdchannel.MAX_FREE_IDS + 1
    whole = fdchannel._frame(fdchannel.REQ_FREE, struct.pack("<QII", 77, n, 0) + bytes(8 * n))
    cut = whole[: fdchannel.MAX_CLIENT_RECORD + 1]
    with pytest.raises(fdchannel.MalformedRequest, match=r"malformed FREE record: 131112 bytes, more than the 131104") as info:
        fdchannel.decode(cut, [], truncated=True)
    assert info.value.req_id == 77
    hello = bytes.fromhex(next(v["hex"] for v in POSITIVE if v["name"] == "hello"))
    with pytest.raises(fdchannel.ProtocolError) as info:
        fdchannel.decode(hello[:40], [], truncated=True)
    assert not isinstance(info.value, fdchannel.MalformedRequest)
    # the header must agree that it was cut: a cut record claiming to be whole is framing broken
    with pytest.raises(fdchannel.ProtocolError) as info:
        fdchannel.decode(fdchannel.encode_close(5), [], truncated=True)
    assert not isinstance(info.value, fdchannel.MalformedRequest)
    # descriptors cut off a request: answered; off a PAGES record: protocol error
    with pytest.raises(fdchannel.MalformedRequest, match="descriptors"):
        fdchannel.decode(fdchannel.encode_close(5), [], fds_truncated=True)
    with pytest.raises(fdchannel.ProtocolError, match="cut on receipt"):
        fdchannel.decode(fdchannel.encode_pages(1, 0, 1, [5]), [1], fds_truncated=True)


def test_free_of_more_than_max_free_ids_is_a_malformed_request():
    n = fdchannel.MAX_FREE_IDS + 1
    rec = fdchannel._frame(fdchannel.REQ_FREE, struct.pack("<QII", 1, n, 0) + bytes(8 * n))
    with pytest.raises(fdchannel.MalformedRequest, match="more than 16384"):
        fdchannel.decode(rec, [])


def test_hello_bytes_match_the_spec():
    rec = fdchannel.encode_hello(fdchannel.Hello(7, 100, 1000, 1001, 253, bytes(range(32))))
    assert rec[:4] == b"KVCF" and rec[4:6] == b"\x01\x00" and rec[6:8] == b"\x01\x00"
    assert int.from_bytes(rec[8:12], "little") == 56 and len(rec) == 16 + 56
    assert int.from_bytes(rec[16:24], "little") == 7
    assert rec[-32:] == bytes(range(32))
    assert fdchannel.decode(rec, []) == fdchannel.Hello(7, 100, 1000, 1001, 253, bytes(range(32)))


def test_pages_round_trip_with_real_fds():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fds = [os.memfd_create("t") for _ in range(3)]
    for i, fd in enumerate(fds):
        os.write(fd, bytes([i]))
    fdchannel.send_record(a, fdchannel.encode_pages(9, 253, 256, [11, 12, 13]), fds)
    rec = fdchannel.recv_record(b)
    assert isinstance(rec, fdchannel.Pages)
    assert (rec.allocation_id, rec.first_index, rec.total, rec.page_ids) == (9, 253, 256, (11, 12, 13))
    for i, fd in enumerate(rec.fds):
        assert os.pread(fd, 1, 0) == bytes([i])
    fdchannel.close_fds(rec.fds + tuple(fds))
    a.close()
    assert fdchannel.recv_record(b) is None


def test_malformed_records_are_rejected():
    good = fdchannel.encode_pages(1, 0, 1, [5])
    with pytest.raises(fdchannel.ProtocolError, match="carries 0 fds"):
        fdchannel.decode(good, [])
    with pytest.raises(fdchannel.ProtocolError, match="bad magic"):
        fdchannel.decode(b"XXXX" + good[4:], [1])
    with pytest.raises(fdchannel.ProtocolError, match="version"):
        fdchannel.decode(good[:4] + b"\x02\x00" + good[6:], [1])
    with pytest.raises(fdchannel.ProtocolError, match="header says"):
        fdchannel.decode(good + b"x", [1])
    with pytest.raises(fdchannel.ProtocolError, match="shorter than the header"):
        fdchannel.decode(b"KV", [])
    with pytest.raises(fdchannel.ProtocolError, match="unknown record type"):
        fdchannel.decode(good[:6] + b"\x7f\x00" + good[8:], [1])
    with pytest.raises(ValueError):  # the encoder refuses what the decoder would
        fdchannel.encode_pages(1, 0, 254, list(range(254)))
    err = fdchannel.decode(fdchannel.encode_error(7, "nope"), [])
    assert err == fdchannel.Error(7, "nope")
    assert fdchannel.decode(fdchannel.encode_goodbye(), []) == fdchannel.Goodbye()


def test_truncated_records_close_their_descriptors():
    """recv_record closes the descriptors of a malformed record itself."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fd = os.memfd_create("t")
    bad = bytes.fromhex(next(v["hex"] for v in NEGATIVE if v["name"] == "pages_past_total"))
    fdchannel.send_record(a, bad, [fd, fd])
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(fdchannel.ProtocolError, match="of an allocation of 2"):
        fdchannel.recv_record(b)
    assert len(os.listdir("/proc/self/fd")) == before  # the two received copies were closed
    os.close(fd)
    a.close()
    b.close()


# ---- the daemon as the receiver ---------------------------------------------------
def _real_fds(n: int) -> list[int]:
    return [os.memfd_create(f"v{i}") for i in range(n)]


def _daemon_fds(d) -> int:
    return len(os.listdir(f"/proc/{d.proc.pid}/fd"))


def _bound_channel(d, c):
    """A raw fd channel with a session bound to it (OpenSession over gRPC)."""
    from helpers.raw import stub
    from kvcached_service._generated.kvcached.v1 import kvcached_pb2 as pb

    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(d.fd_socket)
    s.settimeout(5)
    hello = fdchannel.recv_record(s)
    ref = stub(d).OpenSession(pb.OpenSessionRequest(channel_secret=hello.secret, name="vectors"), timeout=10).session
    return s, ref


def _still_serves(s, req_id: int) -> None:
    """The channel still serves its session: a FREE of nothing it holds is
    answered NOT_FOUND."""
    fdchannel.send_record(s, fdchannel.encode_free(req_id, [424242]))
    rep = fdchannel.recv_record(s)
    assert isinstance(rep, fdchannel.Reply) and rep.req_id == req_id and rep.code == errors.Code.NOT_FOUND, rep


def test_daemon_answers_or_closes_as_each_malformed_vector_says(host_daemon):
    """Every malformed vector, sent on a bound channel whose session holds a
    page: `reply` vectors get REPLY INVALID_ARGUMENT with the vector's req_id
    and message, and the session goes on (its page still held, the channel
    still answers); `close` vectors get ERROR "fd channel protocol error:
    ..." and EOF, and the session ends (its page back)."""
    d = host_daemon
    # every malformed record, whatever its type: a client could send any bytes
    to_daemon = [v for v in NEGATIVE if v["fds"] <= fdchannel.MAX_FDS]
    assert sum(v["daemon"] == "reply" for v in to_daemon) >= 12 and sum(v["daemon"] == "close" for v in to_daemon) >= 20
    with d.client() as c, c.open_session("observer") as observer:  # root: an admin, sees every session
        warm, _ = _bound_channel(d, c)  # the raw stub's gRPC connection exists from here on
        warm.close()
        assert wait_until(lambda: c.stats().sessions_open == 1)
        base = _daemon_fds(d)
        answered = closed = 0
        for v in to_daemon:
            s, ref = _bound_channel(d, c)
            fdchannel.send_record(s, fdchannel.encode_allocate(1 << 40, 1))  # the session holds a page
            assert isinstance(fdchannel.recv_record(s), fdchannel.Pages)
            assert fdchannel.recv_record(s).code == 0
            fds = _real_fds(v["fds"])
            fdchannel.send_record(s, bytes.fromhex(v["hex"]), fds)
            fdchannel.close_fds(fds)
            rec = fdchannel.recv_record(s)
            mine = [x for x in observer.stats().sessions if x.id == ref.id]
            if v["daemon"] == "reply":
                assert isinstance(rec, fdchannel.Reply), (v["name"], rec)
                assert (rec.req_id, rec.code, rec.message) == (int(v["req_id"]), v["reply"]["code"], v["reply"]["message"]), (v["name"], rec)
                assert mine and mine[0].pages_held == 1, (v["name"], mine)  # the session goes on, nothing changed
                _still_serves(s, 99)
                answered += 1
            else:
                assert isinstance(rec, fdchannel.Error), (v["name"], rec)
                assert rec.code == errors.Code.INVALID_ARGUMENT and rec.message.startswith("fd channel protocol error: "), (v["name"], rec)
                assert fdchannel.recv_record(s) is None, v["name"]  # then the daemon closed the channel
                assert not mine, v["name"]  # its session ended with it
                closed += 1
            s.close()
        print(f"\n{answered} malformed requests answered, {closed} channels closed")
        # no descriptor kept, books intact, every page back, still serving
        assert wait_until(lambda: _daemon_fds(d) - c.stats().total.pages_pooled <= base, timeout=5), f"{_daemon_fds(d) - base} fds kept"
        assert wait_until(lambda: c.stats().total.pages_in_use == 0, timeout=5)
        with c.open_session("after") as s2:
            s2.free(s2.allocate(2))
        assert_books(c.stats())
    log = d.log_text()
    assert "protocol error" in log and "answered INVALID_ARGUMENT" in log


def test_daemon_answers_a_request_larger_than_any_client_sends(host_daemon):
    """A FREE of 16,385 ids (8 bytes more than max_client_record) is cut on
    receipt; its req_id arrived, so it is answered and the session goes on."""
    d = host_daemon
    with d.client() as c:
        s, ref = _bound_channel(d, c)
        n = fdchannel.MAX_FREE_IDS + 1
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        fdchannel.send_record(s, fdchannel._frame(fdchannel.REQ_FREE, struct.pack("<QII", 31, n, 0) + bytes(8 * n)))
        rep = fdchannel.recv_record(s)
        assert isinstance(rep, fdchannel.Reply) and rep.req_id == 31 and rep.code == errors.Code.INVALID_ARGUMENT, rep
        assert rep.message == "malformed FREE record: 131112 bytes, more than the 131104 a client may send", rep
        _still_serves(s, 32)
        with c.open_session("observer") as observer:
            assert any(x.id == ref.id for x in observer.stats().sessions)
        s.close()


def test_daemon_drops_well_formed_records_of_the_wrong_direction(host_daemon):
    d = host_daemon
    with d.client() as c:
        s, ref = _bound_channel(d, c)
        base = _daemon_fds(d)
        for v in [u for u in VECTORS["unexpected"] if u["receiver"] == "daemon"]:
            assert v["outcome"] == "drop" and not v["closes_channel"]
            fds = _real_fds(v["fds"])
            fdchannel.send_record(s, bytes.fromhex(v["hex"]), fds)
            fdchannel.close_fds(fds)
        assert wait_until(lambda: _daemon_fds(d) <= base, timeout=5), "the daemon kept descriptors of dropped records"
        _still_serves(s, 77)  # the channel still serves its session
        s.close()


# ---- the Python client as the receiver ----------------------------------------------
class OneShotDaemon:
    """A listening fd socket that sends HELLO and then one given record."""

    def __init__(self, path: str, data: bytes, nfds: int):
        self.path = path
        self.lsock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.lsock.bind(path)
        self.lsock.listen(1)
        self.peer_eof = threading.Event()
        self._t = threading.Thread(target=self._serve, args=(data, nfds), daemon=True)
        self._t.start()

    def _serve(self, data: bytes, nfds: int) -> None:
        conn, _ = self.lsock.accept()
        conn.settimeout(10)
        fdchannel.send_record(conn, fdchannel.encode_hello(fdchannel.Hello(1, 1, 0, 0, 253, bytes(32))))
        fds = _real_fds(nfds)
        fdchannel.send_record(conn, data, fds)
        fdchannel.close_fds(fds)
        try:
            while True:
                rec = fdchannel.recv_record(conn)
                if rec is None:
                    self.peer_eof.set()
                    return
        except OSError:
            self.peer_eof.set()
        finally:
            conn.close()

    def close(self) -> None:
        self.lsock.close()
        self._t.join(5)


# every malformed record (a client never receives requests: a malformed
# one is a protocol error there too) and every record the daemon never sends
CLIENT_CASES = [v for v in NEGATIVE if v["fds"] <= fdchannel.MAX_FDS] + [
    u for u in VECTORS["unexpected"] if u["receiver"] == "client"]


@pytest.mark.parametrize("v", CLIENT_CASES, ids=lambda v: v["name"])
def test_client_treats_the_vector_as_a_protocol_error(v, tmp_path):
    assert v.get("client") == "close" or v.get("closes_channel")
    path = str(tmp_path / "fd.sock")
    fake = OneShotDaemon(path, bytes.fromhex(v["hex"]), v["fds"])
    before = len(os.listdir("/proc/self/fd"))
    hangups = []
    ch = Channel(path, 5, on_hangup=hangups.append)
    try:
        assert wait_until(lambda: ch.ended is not None, timeout=5)
        assert isinstance(ch.ended, ProtocolViolation) and "fd channel protocol error" in ch.ended.message, ch.ended
        assert isinstance(ch.ended, errors.Internal)
        assert fake.peer_eof.wait(5), "the client did not close its end"
        assert not hangups  # a protocol error is not a hang-up: no resume
        with pytest.raises(ProtocolViolation):
            ch.free([1], 1)
    finally:
        ch.close()
        fake.close()
    # the socket and every descriptor that arrived are closed
    assert wait_until(lambda: len(os.listdir("/proc/self/fd")) <= before, timeout=5)


# ---- the daemon's hot path (fdchannel.decode_hot / recv_request) ----------------------------
def _as_hot(rec) -> tuple | None:
    """What decode_hot must return for a record decode() read (None: not a hot one)."""
    if isinstance(rec, fdchannel.AllocateReq) and not rec.device:
        flags = (fdchannel.ALLOC_WAIT if rec.wait else 0) | (fdchannel.ALLOC_NOTIFY if rec.notify else 0)
        return (fdchannel.REQ_ALLOCATE, rec.req_id, rec.num_pages, flags, rec.wait_timeout_ms)
    if isinstance(rec, fdchannel.FreeReq) and len(rec.page_ids) == 1:
        return (fdchannel.REQ_FREE, rec.req_id, rec.page_ids[0], rec.flags)
    return None


def _agree(data: bytes) -> bool:
    """decode_hot(data) is None, or decode(data) reads the same request. True if hot."""
    hot = fdchannel.decode_hot(data)
    if hot is None:
        return False
    rec = fdchannel.decode(data, [])  # must not raise: the hot path accepted it
    assert _as_hot(rec) is not None and hot[:2] == _as_hot(rec)[:2], (data.hex(), hot, rec)
    if hot[0] == fdchannel.REQ_ALLOCATE:  # flags: decode keeps wait/notify only (other bits are ignored)
        assert (hot[2], hot[3] & 3, hot[4]) == (rec.num_pages, _as_hot(rec)[3], rec.wait_timeout_ms), (hot, rec)
    else:
        assert hot == _as_hot(rec), (hot, rec)
    return True


def test_hot_decode_agrees_with_decode_on_every_vector():
    hits = set()
    for v in VECTORS["vectors"]:
        if v["fds"]:
            continue
        if _agree(bytes.fromhex(v["hex"])):
            assert "record" in v, f"decode_hot accepted the malformed vector {v['name']}"
            hits.add(v["record"]["type"])
    for data in (fdchannel.encode_allocate(7, 3, wait=True, notify=True, wait_timeout_ms=250), fdchannel.encode_free(8, [1 << 40])):
        assert _agree(data)
    assert not _agree(fdchannel.encode_allocate(9, 1, device="GPU-0"))  # a device name: decode() reads it
    assert not _agree(fdchannel.encode_free(10, [1, 2]))  # more than one id
    assert hits <= {"ALLOCATE", "FREE"}, hits


def test_hot_decode_never_accepts_what_decode_refuses():
    """Every single-byte change of a hot ALLOCATE and FREE: decode_hot
    either declines it or reads exactly what decode() reads."""
    for base in (fdchannel.encode_allocate(5, 1, wait_timeout_ms=10), fdchannel.encode_free(6, [42])):
        assert _agree(base)
        for i in range(len(base)):
            for val in (0x00, 0x01, 0x02, 0x07, 0x80, 0xFF):
                data = base[:i] + bytes([val]) + base[i + 1 :]
                try:
                    fdchannel.decode(data, [])
                except fdchannel.ProtocolError:
                    assert fdchannel.decode_hot(data) is None, (i, val, data.hex())
                    continue
                _agree(data)
        assert fdchannel.decode_hot(base[:-1]) is None and fdchannel.decode_hot(base + b"\0") is None


def test_recv_request_reads_hot_requests_as_tuples_and_the_rest_as_records():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b:
        a.send(fdchannel.encode_allocate(1, 1, wait=True))
        assert fdchannel.recv_request(b) == (fdchannel.REQ_ALLOCATE, 1, 1, fdchannel.ALLOC_WAIT, 0)
        a.send(fdchannel.encode_free(2, [77]))
        assert fdchannel.recv_request(b) == (fdchannel.REQ_FREE, 2, 77, 0)
        a.send(fdchannel.encode_free(3, [77, 78]))
        assert fdchannel.recv_request(b) == fdchannel.FreeReq(3, (77, 78))
        a.send(fdchannel.encode_allocate(4, 2, device="HOST-0"))
        assert fdchannel.recv_request(b) == fdchannel.AllocateReq(4, 2, False, False, 0, "HOST-0")
        # a hot-shaped request with a descriptor attached is a malformed request, as decode() says
        r, w = os.pipe()
        try:
            fdchannel.send_record(a, fdchannel.encode_free(5, [9]), [r])
            with pytest.raises(fdchannel.MalformedRequest) as info:
                fdchannel.recv_request(b)
            assert info.value.req_id == 5
        finally:
            os.close(r)
            os.close(w)
        a.close()
        assert fdchannel.recv_request(b) is None


def test_requests_before_open_session_are_refused_and_the_channel_stays(host_daemon):
    """A request on a channel no session is bound to yet gets REPLY
    FAILED_PRECONDITION, whichever decoder read it: the one-page FREE and
    the plain ALLOCATE (the daemon's fast path, fdchannel.decode_hot) and
    an ALLOCATE naming a device or a FREE of two pages (the full decoder).
    The channel stays: OpenSession binds it afterwards and it serves."""
    from helpers.raw import stub
    from kvcached_service._generated.kvcached.v1 import kvcached_pb2 as pb

    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(host_daemon.fd_socket)
    s.settimeout(5)
    try:
        hello = fdchannel.recv_record(s)
        requests = [
            fdchannel.encode_allocate(1, 1),
            fdchannel.encode_free(2, [7]),
            fdchannel.encode_allocate(3, 1, device="HOST-0"),
            fdchannel.encode_free(4, [7, 8]),
        ]
        for i, rec in enumerate(requests, 1):
            fdchannel.send_record(s, rec)
            rep = fdchannel.recv_record(s)
            assert isinstance(rep, fdchannel.Reply) and rep.req_id == i, rep
            assert rep.code == errors.Code.FAILED_PRECONDITION and "OpenSession first" in rep.message, rep
        stub(host_daemon).OpenSession(pb.OpenSessionRequest(channel_secret=hello.secret, name="late"), timeout=10)
        _still_serves(s, 5)
    finally:
        s.close()


def _full(sock: socket.socket) -> int:
    """Fill `sock`'s send buffer (non-blocking) with small records; returns how many went."""
    sock.setblocking(False)
    n = 0
    while True:
        try:
            sock.send(b"x" * 64)
        except BlockingIOError:
            return n
        n += 1


def test_send_answer_sends_pages_then_reply_or_says_how_far_it_got(tmp_path):
    """The daemon's one codec call for a one-record answer (PAGES, then
    REPLY): both arrive in that order with the fds; on a full socket it
    sends nothing (0) and raises nothing, and with room for the PAGES only
    it says 1, so the caller sends the REPLY when there is room."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    f = tmp_path / "page"
    f.write_bytes(b"p" * 16)
    fd = os.open(f, os.O_RDONLY)
    try:
        a.setblocking(False)
        assert fdchannel.send_answer(a, 7 | fdchannel.CHANNEL_ALLOC_BIT, [42], [fd], 7, 2 << 20) == 2
        pages, reply = fdchannel.recv_record(b), fdchannel.recv_record(b)
        assert isinstance(pages, fdchannel.Pages) and pages.page_ids == (42,) and len(pages.fds) == 1
        assert os.read(pages.fds[0], 16) == b"p" * 16  # the page's own descriptor, passed
        fdchannel.close_fds(pages.fds)
        assert isinstance(reply, fdchannel.Reply) and (reply.req_id, reply.code, reply.value) == (7, 0, 2 << 20)

        sent = _full(a)
        assert fdchannel.send_answer(a, 8, [43], [fd], 8, 0) == 0  # full: nothing sent, nothing raised
        for _ in range(sent):
            b.recv(128)
        assert fdchannel.send_answer(a, 8, [43], [fd], 8, 0) == 2
        fdchannel.close_fds(fdchannel.recv_record(b).fds)
        fdchannel.recv_record(b)
        assert fdchannel.send_answer(a, 9, [], [], 9, 0) == 0  # not a one-record answer: the caller's slow path
        assert fdchannel.send_answer(a, 9, list(range(fdchannel.MAX_FDS + 1)), [fd] * (fdchannel.MAX_FDS + 1), 9, 0) == 0
    finally:
        os.close(fd)
        a.close()
        b.close()


def test_send_answer_with_room_for_the_pages_only_says_1(tmp_path):
    """Room for one more record of the PAGES' size but not the REPLY: the
    buffer is filled, then exactly one record's room is made by reading the
    receiver's oldest record until a PAGES goes and the REPLY does not."""
    f = tmp_path / "page"
    f.write_bytes(b"q")
    fd = os.open(f, os.O_RDONLY)
    seen = set()
    try:
        for _ in range(50):  # the kernel's accounting decides where the buffer ends: try until both cases showed
            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                _full(a)
                b.recv(128)  # room for about one record
                got = fdchannel.send_answer(a, 5, [44], [fd], 5, 0)
                seen.add(got)
                if got == 1:  # the PAGES went, the REPLY did not: the caller sends it later, in order
                    while True:  # the filler records, then the PAGES
                        data, anc, flags, _ = b.recvmsg(4096, socket.CMSG_SPACE(4 * fdchannel.MAX_FDS))
                        if data[:1] != b"x":
                            rec = fdchannel._parse_received(data, anc, flags)
                            assert isinstance(rec, fdchannel.Pages) and rec.page_ids == (44,)
                            fdchannel.close_fds(rec.fds)
                            break
                    a.setblocking(True)
                    fdchannel.send_record(a, fdchannel.encode_reply(5, 0, 0))
                    assert isinstance(fdchannel.recv_record(b), fdchannel.Reply)
                    break
            finally:
                a.close()
                b.close()
        assert 1 in seen, seen
    finally:
        os.close(fd)
