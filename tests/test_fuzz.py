"""Fuzzing (issue 9, invariant 5): every rpc with inputs generated from the
proto's own descriptors, random bytes as message bodies, and random records
on the fd channel. After every example: the daemon is alive, answered within
the deadline with a documented status code (and a message), still serves
(GetInfo, and GetStats whose books add up), and holds no descriptor it was
sent for nothing.

The strategies are built generically from the message descriptors (every
scalar type, enums (open), nested messages, repeated fields and maps), with
a few "interesting" values mixed in by field name (a live SessionRef, a
live channel secret, page ids the session holds, small page counts) so
the examples get past the first check and reach the daemon's deeper logic.
"""

from __future__ import annotations

import array
import os
import socket
import struct
import time

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor as FD
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtest import assert_books, wait_until
from kvcached_service import fdchannel
from kvcached_service._generated.kvcached.v1 import kvcached_pb2 as pb
from kvcached_service._generated.kvcached.v1 import kvcached_pb2_grpc as pb_grpc

C = grpc.StatusCode
SERVICE = pb.DESCRIPTOR.services_by_name["KVCached"]
METHODS = [m.name for m in SERVICE.methods]
# docs/protocol.md: the codes a request can get (UNAVAILABLE only while
# shutting down, DEADLINE_EXCEEDED only for the caller's own deadline and
# INTERNAL only for a backend failure: none of them may happen here).
DOCUMENTED = {C.OK, C.INVALID_ARGUMENT, C.NOT_FOUND, C.PERMISSION_DENIED, C.RESOURCE_EXHAUSTED, C.FAILED_PRECONDITION}
DEADLINE = 5.0
def fuzz_settings(n: int) -> settings:
    return settings(max_examples=n, deadline=None, suppress_health_check=list(HealthCheck), database=None)

# ---- strategies from descriptors --------------------------------------------
REF, BAD_TOKEN, SECRET, HELD, HELD1, SID = "$REF", "$BAD_TOKEN", "$SECRET", "$HELD", "$HELD1", "$SID"

_INT = {
    FD.TYPE_INT32: (-(2**31), 2**31 - 1), FD.TYPE_SINT32: (-(2**31), 2**31 - 1), FD.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FD.TYPE_UINT32: (0, 2**32 - 1), FD.TYPE_FIXED32: (0, 2**32 - 1),
    FD.TYPE_INT64: (-(2**63), 2**63 - 1), FD.TYPE_SINT64: (-(2**63), 2**63 - 1), FD.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FD.TYPE_UINT64: (0, 2**64 - 1), FD.TYPE_FIXED64: (0, 2**64 - 1),
}


def is_repeated(f) -> bool:
    rep = getattr(f, "is_repeated", None)  # protobuf >= 5.29; `label` is going away
    return rep if rep is not None else f.label == FD.LABEL_REPEATED


def scalar(f) -> st.SearchStrategy:
    t = f.type
    if t in _INT:
        lo, hi = _INT[t]
        return st.one_of(st.integers(max(lo, -3), min(hi, 40)), st.integers(lo, hi), st.sampled_from([lo, hi]))
    if t == FD.TYPE_BOOL:
        return st.booleans()
    if t == FD.TYPE_DOUBLE:
        return st.floats(allow_nan=True, allow_infinity=True)
    if t == FD.TYPE_FLOAT:
        return st.floats(width=32, allow_nan=True, allow_infinity=True)
    if t == FD.TYPE_STRING:
        return st.one_of(st.text(max_size=40), st.text(min_size=100, max_size=400), st.just(""))
    if t == FD.TYPE_BYTES:
        return st.one_of(st.binary(max_size=40), st.binary(min_size=32, max_size=32))
    if t == FD.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in f.enum_type.values]), st.integers(-(2**31), 2**31 - 1))
    raise AssertionError(f"unhandled field type {t} of {f.full_name}")


def interesting(f, favour: bool = False) -> st.SearchStrategy | None:
    """Values that let an example reach past the first check (favour: only
    values that pass it)."""
    if f.message_type is not None and f.message_type.name == "SessionRef":
        return st.just(REF) if favour else st.sampled_from([REF, BAD_TOKEN])
    if f.name == "channel_secret":
        return st.just(SECRET)
    if f.name == "page_ids":
        if favour:
            return st.lists(st.sampled_from([HELD, HELD1]), min_size=1, max_size=2, unique=True)
        return st.lists(st.one_of(st.just(HELD), st.just(HELD1), st.integers(0, 2**64 - 1)), max_size=6)
    if f.name in ("session_id",):
        return st.just(SID)
    if f.name == "num_pages":
        return st.integers(1, 12) if favour else st.integers(0, 12)
    if f.name == "device":
        return st.sampled_from(["", "HOST-0"] if favour else ["", "HOST-0", "GPU-0", "HOST-0\0"])
    if f.name == "set_fields":
        if favour:
            return st.lists(st.sampled_from(["guaranteed_bytes", "max_bytes", "priority"]), min_size=1, max_size=3, unique=True)
        return st.lists(st.sampled_from(["guaranteed_bytes", "max_bytes", "priority", "bogus", ""]), max_size=4)
    if favour and f.name == "name":
        return st.text(st.characters(min_codepoint=32, max_codepoint=0x2FFF, blacklist_categories=("Cs", "Cc", "Zl", "Zp")), min_size=1, max_size=20)
    if f.name in ("guaranteed_bytes", "max_bytes", "target_bytes"):
        return st.sampled_from([0, 1, 65536, 1 << 20, 1 << 26, 1 << 27, 2**64 - 1])
    if f.name in ("wait_timeout_ms", "timeout_ms"):
        return st.integers(0, 300)
    if f.name == "labels":
        return st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=20)
    return None


def field_strategy(f, depth: int) -> st.SearchStrategy:
    if f.message_type is not None and f.message_type.GetOptions().map_entry:
        k, v = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
        return st.dictionaries(scalar(k), field_strategy(v, depth + 1), max_size=20)
    if f.message_type is not None:
        one = message_dict(f.message_type, depth + 1)
    else:
        one = scalar(f)
    if is_repeated(f):
        return st.lists(one, max_size=8)
    return one


def message_dict(desc, depth: int = 0, favour: bool = False) -> st.SearchStrategy:
    """A dict field name -> value (possibly a sentinel) for `desc`; fields
    may be absent. Nesting stops at depth 3. favour: every field that has
    interesting values is present and takes one of them."""
    if depth > 3:
        return st.just({})
    required, optional = {}, {}
    for f in desc.fields:
        gen = field_strategy(f, depth)
        extra = interesting(f, favour)
        if favour and extra is not None:
            required[f.name] = extra
        else:
            optional[f.name] = st.one_of(extra, gen) if extra is not None else gen
    return st.fixed_dictionaries(required, optional=optional)


def request_strategy(desc) -> st.SearchStrategy:
    """Half fully random requests, half requests likely to get through."""
    return st.one_of(message_dict(desc), message_dict(desc, favour=True))


def build(desc, values: dict, ctx: "Ctx"):
    """The message for `desc` from `values`, with sentinels resolved."""
    msg = message_factory.GetMessageClass(desc)()
    for name, v in values.items():
        f = desc.fields_by_name[name]
        target = getattr(msg, name)
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            vf = f.message_type.fields_by_name["value"]
            for k, vv in v.items():
                if vf.message_type is not None:
                    target[k].CopyFrom(build(vf.message_type, vv, ctx))
                else:
                    target[k] = vv
        elif is_repeated(f):
            for item in v:
                if f.message_type is not None:
                    target.add().CopyFrom(build(f.message_type, item, ctx))
                else:
                    target.append(ctx.resolve(item))
        elif f.message_type is not None:
            if v == REF:
                target.CopyFrom(ctx.ref)
            elif v == BAD_TOKEN:
                target.CopyFrom(pb.SessionRef(id=ctx.ref.id, token=bytes(32)))
            else:
                target.CopyFrom(build(f.message_type, v, ctx))
        else:
            setattr(msg, name, ctx.resolve(v))
    return msg


# ---- the daemon under fuzz ---------------------------------------------------
def daemon_fds(d) -> int:
    return len(os.listdir(f"/proc/{d.proc.pid}/fd"))


class Ctx:
    """One session on a raw fd channel (this test reads its PAGES records
    and closes their fds), plus a fresh unbound channel for secrets."""

    def __init__(self, d):
        self.d = d
        self.grpc = grpc.insecure_channel(f"unix:{d.socket}")
        self.stub = pb_grpc.KVCachedStub(self.grpc)
        self.sock = None
        self.spare = None
        self.held: list[int] = []
        self.open()

    def channel(self) -> tuple[socket.socket, bytes]:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(self.d.fd_socket)
        s.settimeout(5)
        hello = fdchannel.recv_record(s)
        assert isinstance(hello, fdchannel.Hello), hello
        s.setblocking(False)
        return s, hello.secret

    def open(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock, secret = self.channel()
        self.ref = self.stub.OpenSession(pb.OpenSessionRequest(channel_secret=secret, name="fuzz"), timeout=DEADLINE).session
        self.held = []
        self.new_spare()

    def new_spare(self) -> None:
        if self.spare is not None:
            self.spare[0].close()
        self.spare = self.channel()

    def resolve(self, v):
        if v == HELD:
            return self.held[0] if self.held else 1
        if v == HELD1:
            return self.held[1] if len(self.held) > 1 else 2
        if v == SID:
            return self.ref.id
        if v == SECRET:
            return self.spare[1]
        return v

    def drain(self) -> None:
        while True:
            try:
                rec = fdchannel.recv_record(self.sock)
            except BlockingIOError:
                return
            except fdchannel.ProtocolError as exc:
                raise AssertionError(f"the daemon sent a malformed record: {exc}")
            except OSError:
                return
            if rec is None:
                return
            fdchannel.close_fds(getattr(rec, "fds", ()))

    def after(self) -> None:
        """The daemon is alive and serving; books add up; reset our session."""
        d = self.d
        assert d.proc.poll() is None, "daemon died:\n" + d.log_text()[-3000:]
        info = self.stub.GetInfo(pb.GetInfoRequest(), timeout=DEADLINE)
        assert info.devices
        self.drain()
        try:
            st = self.stub.GetStats(pb.GetStatsRequest(session=self.ref), timeout=DEADLINE)
            alive = True
        except grpc.RpcError as exc:
            assert exc.code() in (C.FAILED_PRECONDITION,), (exc.code(), exc.details())  # our session was closed
            st = self.stub.GetStats(pb.GetStatsRequest(), timeout=DEADLINE)
            alive = False
        for p in [st.total, *(x.pool for x in st.devices)]:
            assert p.pooled_bytes + p.in_use_bytes + p.free_bytes == p.budget_bytes, p
        if alive:  # undo limits an example may have set on our own session
            self.stub.SetSessionLimits(pb.SetSessionLimitsRequest(
                admin=self.ref, session_id=self.ref.id, set_fields=["guaranteed_bytes", "max_bytes", "priority"]), timeout=DEADLINE)
        if alive and self.held:
            me = [s for s in st.sessions if s.id == self.ref.id]
            if me and me[0].pages_held:
                try:
                    self.stub.Free(pb.FreeRequest(session=self.ref, page_ids=self.held), timeout=DEADLINE)
                except grpc.RpcError as exc:  # some were freed by the example itself
                    assert exc.code() == C.NOT_FOUND, exc.details()
                    for pid in self.held:
                        try:
                            self.stub.Free(pb.FreeRequest(session=self.ref, page_ids=[pid]), timeout=DEADLINE)
                        except grpc.RpcError as e2:
                            assert e2.code() == C.NOT_FOUND, e2.details()
            self.held = []
        if not alive:
            self.open()
        elif self.spare[0].fileno() < 0 or self._spare_used():
            self.new_spare()

    def _spare_used(self) -> bool:
        try:
            data = self.spare[0].recv(1, socket.MSG_PEEK)
            return data == b"" or True
        except BlockingIOError:
            return False
        except OSError:
            return True

    def close(self) -> None:
        self.sock.close()
        self.spare[0].close()
        self.grpc.close()


@pytest.fixture
def fuzz(daemon_factory):
    # a small budget, short waits: examples stay fast; a journal so that
    # ResumeSession gets past "no state directory"
    import tempfile

    state = tempfile.mkdtemp(prefix="kvc-fuzz-state-")
    d = daemon_factory("host", memory_limit="64MiB", page_size="1MiB", default_wait_ms="100",
                       reclaim_timeout_ms="100", state_dir=state, log_level="WARNING", grpc_page_ops=True)
    ctx = Ctx(d)
    yield ctx
    ctx.close()
    assert_books_final(ctx)


def assert_books_final(ctx: Ctx) -> None:
    with ctx.d.client() as c:
        assert wait_until(lambda: c.stats().total.in_use_bytes == 0, timeout=3), c.stats().total
        assert_books(c.stats())


def call(ctx: Ctx, method: str, req):
    """Run one rpc with a deadline; returns (code, details, response)."""
    m = SERVICE.methods_by_name[method]
    stub_fn = getattr(ctx.stub, method)
    try:
        if m.server_streaming:
            stream = stub_fn(req, timeout=DEADLINE)
            first = next(iter(stream))
            stream.cancel()
            return C.OK, "", first
        return C.OK, "", stub_fn(req, timeout=DEADLINE)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", None


def check_status(method: str, code, details: str, req) -> None:
    assert code != C.DEADLINE_EXCEEDED, f"{method} hung (no answer within {DEADLINE} s) for {req!r:.300}"
    assert code in DOCUMENTED, f"{method} answered {code.name}: {details!r} for {req!r:.500}"
    if code != C.OK:
        assert len(details) >= 10, f"{method}: {code.name} with no useful message: {details!r}"


@pytest.mark.parametrize("method", METHODS)
def test_rpc_fuzz(fuzz, method):
    desc = SERVICE.methods_by_name[method].input_type
    seen: dict = {}

    @fuzz_settings(80)
    @given(values=request_strategy(desc))
    def one(values):
        if not fuzz.held:  # pages for Free (and the rest) to name
            fuzz.held = list(fuzz.stub.Allocate(pb.AllocateRequest(session=fuzz.ref, num_pages=2), timeout=DEADLINE).page_ids)
        req = build(desc, values, fuzz)
        code, details, resp = call(fuzz, method, req)
        seen[code.name] = seen.get(code.name, 0) + 1
        check_status(method, code, details, req)
        if method == "Allocate" and code == C.OK:
            fuzz.held.extend(resp.page_ids)
        fuzz.after()

    one()
    print(f"\n{method}: {seen}")
    # the strategies reach past the first check: some calls succeed, some fail
    if method not in ("ResumeSession",):
        assert seen.get("OK", 0) >= 1, f"{method}: no example got through: {seen}"
    if desc.fields:  # GetInfoRequest has no field: one example is all there is
        assert len(seen) >= 2, f"{method}: only {seen}"


def test_raw_bytes_bodies(fuzz):
    """Random bytes as the body of every method (and unknown ones)."""
    seen: dict = {}

    @fuzz_settings(300)
    @given(method=st.sampled_from(METHODS + ["Bogus", ""]), body=st.one_of(st.binary(max_size=64), st.binary(min_size=200, max_size=3000)))
    def one(method, body):
        path = f"/{SERVICE.full_name}/{method}"
        streaming = method in SERVICE.methods_by_name and SERVICE.methods_by_name[method].server_streaming
        try:
            if streaming:
                it = fuzz.grpc.unary_stream(path)(body, timeout=DEADLINE)
                next(iter(it))
                it.cancel()
            else:
                fuzz.grpc.unary_unary(path)(body, timeout=DEADLINE)
            code, details = C.OK, ""
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
        except StopIteration:
            code, details = C.OK, ""
        seen[code.name] = seen.get(code.name, 0) + 1
        if method not in SERVICE.methods_by_name:
            assert code == C.UNIMPLEMENTED, (method, code, details)
        else:  # a body that does not parse is INVALID_ARGUMENT like any bad input
            check_status(method, code, details, body)
        fuzz.after()

    one()
    print(f"\nraw bodies: {seen}")


def test_undecodable_body_gets_invalid_argument(fuzz):
    """Invariant 5: a body that is not a valid message is bad input and must
    get INVALID_ARGUMENT with a message naming the message type. (Left to
    grpcio, it answers UNKNOWN "Unexpected DecodeError" before the servicer
    runs: the daemon decodes request bodies itself.)"""
    for method in ("Allocate", "Free", "GetStats", "OpenSession"):
        with pytest.raises(grpc.RpcError) as info:
            fuzz.grpc.unary_unary(f"/{SERVICE.full_name}/{method}")(b"\x0a\xff\xff", timeout=DEADLINE)
        err = info.value
        assert err.code() == C.INVALID_ARGUMENT, f"{method}: {err.code().name}: {err.details()}"
        assert SERVICE.methods_by_name[method].input_type.name in err.details(), err.details()
    fuzz.after()


# ---- the fd channel's framing ------------------------------------------------
HDR = struct.Struct("<IHHII")


def _fds(kinds: list[str]) -> tuple[list[int], list[int]]:
    """Descriptors of various kinds to attach; (to send, to close after)."""
    send, close = [], []
    for k in kinds:
        if k == "pipe":
            r, w = os.pipe()
            send.append(r)
            close += [r, w]
        elif k == "memfd":
            fd = os.memfd_create("fuzz")
            os.ftruncate(fd, 4096)
            send.append(fd)
            close.append(fd)
        elif k == "devnull":
            fd = os.open("/dev/null", os.O_RDONLY)
            send.append(fd)
            close.append(fd)
        elif k == "socket":
            a, b = socket.socketpair()
            send.append(a.detach())
            close += [send[-1], b.detach()]
        elif k == "eventfd":
            fd = os.eventfd(0)
            send.append(fd)
            close.append(fd)
    return send, close


def record_strategy(session_id_choices: list[int]) -> st.SearchStrategy:
    kinds = st.lists(st.sampled_from(["pipe", "memfd", "devnull", "socket", "eventfd"]), max_size=5)
    raw = st.tuples(st.one_of(st.binary(min_size=1, max_size=80), st.binary(min_size=4000, max_size=20000)), kinds)

    @st.composite
    def framed(draw):
        kind = draw(st.one_of(st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, 9, 10]), st.integers(0, 65535)))
        magic = draw(st.one_of(st.just(fdchannel.MAGIC), st.integers(0, 2**32 - 1)))
        version = draw(st.one_of(st.just(fdchannel.VERSION), st.integers(0, 65535)))
        fdk = draw(kinds)
        if kind in (2, 5) and draw(st.booleans()):
            count = draw(st.one_of(st.just(len(fdk)), st.integers(0, 300)))
            ids = draw(st.lists(st.integers(0, 2**64 - 1), min_size=count, max_size=count)) if count <= 300 else []
            first = draw(st.sampled_from(session_id_choices + [0, 2**64 - 1]))
            payload = struct.pack("<QIIII", first, draw(st.integers(0, 2**32 - 1)), count, draw(st.integers(0, 2**32 - 1)), 0)
            payload += b"".join(struct.pack("<Q", i) for i in ids)
        else:
            payload = draw(st.binary(max_size=120))
        length = draw(st.one_of(st.just(len(payload)), st.integers(0, 2**32 - 1)))
        return HDR.pack(magic, version, kind, length, draw(st.integers(0, 2**32 - 1))) + payload, fdk

    @st.composite
    def adopt(draw):
        """A well-formed ADOPT record (for a session that is not an orphan of
        a previous daemon), 1-5 fds attached."""
        fdk = draw(st.lists(st.sampled_from(["pipe", "memfd", "devnull", "socket", "eventfd"]), min_size=1, max_size=5))
        sid = draw(st.sampled_from(session_id_choices + [0, 2**64 - 1]))
        ids = draw(st.lists(st.integers(0, 2**64 - 1), min_size=len(fdk), max_size=len(fdk)))
        return fdchannel.encode_adopt(sid, 0, len(ids), ids), fdk

    return st.one_of(raw, framed(), adopt())


def _send(sock: socket.socket, data: bytes, fds: list[int]) -> bool:
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    try:
        sock.sendmsg([data], anc)
        return True
    except OSError:  # too big for the socket, or the daemon already closed it
        return False


def test_fd_channel_framing_fuzz(fuzz):
    """Random, truncated, oversized records, bad magic/version/type/length,
    fds attached to nonsense, ADOPT records for unknown sessions: nothing
    crashes the daemon, it keeps no descriptor it was sent for nothing, and
    it keeps serving."""
    d = fuzz.d
    st0 = fuzz.stub.GetStats(pb.GetStatsRequest(), timeout=DEADLINE).total
    pages0 = st0.pages_pooled + st0.pages_in_use
    base = daemon_fds(d) - pages0
    kept: list[str] = []

    def fds_now() -> int:
        t = fuzz.stub.GetStats(pb.GetStatsRequest(), timeout=DEADLINE).total
        return daemon_fds(d) - (t.pages_pooled + t.pages_in_use)

    @fuzz_settings(250)
    @given(records=st.lists(record_strategy([fuzz.ref.id, 1, 2, 3]), min_size=1, max_size=6), bind=st.booleans())
    def one(records, bind):
        sock, secret = fuzz.channel()
        if bind:
            fuzz.stub.OpenSession(pb.OpenSessionRequest(channel_secret=secret, name="framing"), timeout=DEADLINE)
        with_channel = fds_now()  # our channel: its socket and the pidfd of this process
        attached = 0
        for data, kinds in records:
            send, close = _fds(kinds)
            if _send(sock, data, send):
                attached += len(send)
            fdchannel.close_fds(close)
        # every descriptor sent for nothing is closed at once (the channel stays open)
        if not wait_until(lambda: fds_now() <= with_channel, timeout=2):
            kept.append(f"{fds_now() - with_channel} of {attached} fds kept while the channel is open; records "
                        + ", ".join(f"{data[:16].hex()}.. ({len(data)} B, {len(k)} fds)" for data, k in records))
        sock.close()
        assert wait_until(lambda: fds_now() <= base + 2, timeout=2), f"daemon keeps {fds_now() - base} fds after the channel closed"
        fuzz.after()

    one()
    assert not kept, f"the daemon kept descriptors it was sent for nothing in {len(kept)} examples, e.g.:\n" + "\n".join(kept[:5])


@st.composite
def request_record(draw):
    """A request record (ALLOCATE, FREE, CLOSE, ANSWER) with a sound or
    broken header, any payload length, sometimes descriptors: most are
    malformed requests the daemon must answer, some are well-formed."""
    kind = draw(st.sampled_from([fdchannel.REQ_ALLOCATE, fdchannel.REQ_FREE, fdchannel.REQ_CLOSE, fdchannel.REQ_ANSWER]))
    req = draw(st.integers(1, 2**62))
    body = draw(st.one_of(
        st.binary(max_size=7),  # no req_id
        st.binary(max_size=60),
        st.builds(lambda n, c, extra: struct.pack("<II", n, c) + extra, st.integers(0, 40), st.integers(0, 40), st.binary(max_size=48)),
    ))
    payload = struct.pack("<Q", req) + body if draw(st.booleans()) or len(body) < 8 else body
    length = draw(st.one_of(st.just(len(payload)), st.just(len(payload)), st.integers(0, 200)))
    version = draw(st.one_of(st.just(fdchannel.VERSION), st.just(fdchannel.VERSION), st.integers(0, 3)))
    fdk = draw(st.one_of(st.just([]), st.just([]), st.lists(st.sampled_from(["pipe", "memfd", "eventfd"]), min_size=1, max_size=3)))
    return HDR.pack(fdchannel.MAGIC, version, kind, length, 0) + payload, fdk


def test_fd_channel_request_fuzz(fuzz):
    """Request records of every type, malformed in every way, on a bound
    channel: what the codec calls a malformed request gets REPLY
    INVALID_ARGUMENT with its req_id and message and the session goes on;
    what it calls a protocol error gets ERROR and the channel closes; a
    well-formed one gets its REPLY. Nothing hangs, no descriptor is kept,
    the books add up."""
    seen = {"reply": 0, "close": 0, "served": 0}

    @fuzz_settings(200)
    @given(records=st.lists(request_record(), min_size=1, max_size=5))
    def one(records):
        sock, secret = fuzz.channel()
        fuzz.stub.OpenSession(pb.OpenSessionRequest(channel_secret=secret, name="requests"), timeout=DEADLINE)
        sock.setblocking(True)
        sock.settimeout(DEADLINE)
        for data, kinds in records:
            send, close = _fds(kinds)
            try:
                expect = fdchannel.decode(data, send)  # the codec's verdict (fds not consumed)
            except fdchannel.MalformedRequest as exc:
                expect = exc
            except fdchannel.ProtocolError as exc:
                expect = exc
            sent = _send(sock, data, send)
            fdchannel.close_fds(close)
            assert sent
            while True:  # PAGES of a well-formed ALLOCATE come first
                rec = fdchannel.recv_record(sock)
                if not isinstance(rec, fdchannel.Pages):
                    break
                fdchannel.close_fds(rec.fds)
            if isinstance(expect, fdchannel.MalformedRequest):
                assert isinstance(rec, fdchannel.Reply) and rec.req_id == expect.req_id, (data.hex(), rec)
                assert rec.code == 3 and rec.message == expect.message, (data.hex(), rec)
                seen["reply"] += 1
            elif isinstance(expect, fdchannel.ProtocolError):
                assert isinstance(rec, fdchannel.Error) and rec.code == 3 and "protocol error" in rec.message, (data.hex(), rec)
                assert fdchannel.recv_record(sock) is None
                seen["close"] += 1
                break
            else:
                assert isinstance(rec, (fdchannel.Reply, fdchannel.Goodbye)), (data.hex(), rec)
                seen["served"] += 1
                if isinstance(expect, fdchannel.CloseReq):
                    break
                if isinstance(rec, fdchannel.Reply) and isinstance(expect, fdchannel.AllocateReq) and rec.code == 0:
                    pass  # the session ends with the channel below: its pages go back
        sock.close()
        fuzz.after()

    one()
    print(f"\nrequest fuzz: {seen['reply']} answered as malformed, {seen['close']} channels closed, {seen['served']} served")
    assert seen["reply"] >= 50 and seen["close"] >= 10


def test_fd_channel_flood(fuzz):
    """20,000 garbage records (every 10th with a descriptor) as fast as the
    socket takes them, on several channels, while a bystander allocates and
    frees: the daemon keeps serving, closes every descriptor, and the
    flooding channels stay usable or are closed, nothing else."""
    d = fuzz.d
    base = daemon_fds(d)
    socks = [fuzz.channel()[0] for _ in range(4)]
    for s in socks:
        s.setblocking(True)
        s.settimeout(5)
    r, w = os.pipe()
    t0 = time.monotonic()
    served = 0
    with d.client() as c, c.open_session("bystander") as by:
        by.free(by.allocate(4))  # its pages exist before the baseline
        base = daemon_fds(d)
        for i in range(20000):
            s = socks[i % len(socks)]
            data = os.urandom(8 + i % 200)
            _send(s, data, [r] if i % 10 == 0 else [])
            if i % 500 == 0:
                by.free(by.allocate(4))
                served += 1
        elapsed = time.monotonic() - t0
        os.close(r)
        os.close(w)
        assert wait_until(lambda: daemon_fds(d) <= base, timeout=5), f"daemon keeps {daemon_fds(d) - base} fds after the flood"
        by.free(by.allocate(4))
        assert_books(c.stats())
    for s in socks:
        s.close()
    print(f"\nflood: 20000 records on 4 channels in {elapsed:.2f} s, bystander served {served} times meanwhile")
    assert d.proc.poll() is None
