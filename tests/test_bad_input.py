"""Invariant 5: every rpc answers bad input with a precise status and a
message that says what was wrong, loses nothing, and the daemon keeps
serving. Invariant 3: a session only touches its own pages."""

from __future__ import annotations

import socket

import grpc
import pytest

from kvtest import assert_books
from kvcached_service import fdchannel
from kvcached_service._generated.kvcached.v1 import kvcached_pb2 as pb
from kvcached_service._generated.kvcached.v1 import kvcached_pb2_grpc as pb_grpc
from helpers.raw import ref

C = grpc.StatusCode


@pytest.fixture
def env(daemon_factory):
    # the gRPC page rpcs (Allocate, Free, CloseSession) are what these tests
    # feed bad input to: served with --grpc-page-ops (for tools); the fd
    # channel's requests reach the same core checks (test_fdchannel.py)
    host_daemon = daemon_factory("host", grpc_page_ops=True)
    c = host_daemon.client()
    a = c.open_session("a")
    b = c.open_session("b")
    stub = pb_grpc.KVCachedStub(grpc.insecure_channel(f"unix:{host_daemon.socket}"))
    yield host_daemon, c, a, b, stub
    a.close()
    b.close()
    c.close()


def expect(call, code: grpc.StatusCode, *fragments: str):
    with pytest.raises(grpc.RpcError) as info:
        call()
    err = info.value
    assert err.code() == code, f"expected {code.name}, got {err.code().name}: {err.details()}"
    for f in fragments:
        assert f in err.details(), f"{f!r} not in {err.details()!r}"
    return err.details()


def still_serving(c, a):
    pages = a.allocate(1)
    a.free(pages)
    assert_books(c.stats())


def test_allocate_bad_counts(env):
    d, c, a, b, stub = env
    for n, frag in [(0, "num_pages must be 1..65536, got 0"), (65537, "got 65537"), (2**32 - 1, "got 4294967295")]:
        expect(lambda: stub.Allocate(pb.AllocateRequest(session=ref(a), num_pages=n)), C.INVALID_ARGUMENT, frag)
    still_serving(c, a)


def test_allocate_beyond_budget(env):
    d, c, a, b, stub = env
    msg = expect(lambda: stub.Allocate(pb.AllocateRequest(session=ref(a), num_pages=129)), C.RESOURCE_EXHAUSTED, "maximum of 128 pages")
    assert "session" in msg
    held = a.allocate(100)
    expect(lambda: stub.Allocate(pb.AllocateRequest(session=ref(b), num_pages=40)), C.RESOURCE_EXHAUSTED,
           "cannot allocate 40 pages", "28 pages free", f"session {a.id} 'a'")
    a.free(held)
    still_serving(c, a)


def test_unknown_device(env):
    d, c, a, b, stub = env
    expect(lambda: stub.Allocate(pb.AllocateRequest(session=ref(a), num_pages=1, device="GPU-nope")), C.NOT_FOUND, "no device 'GPU-nope'", "HOST-0")


def test_session_ref_errors_on_every_rpc(env):
    d, c, a, b, stub = env
    missing = pb.SessionRef()
    unknown = pb.SessionRef(id=999999, token=b"x" * 32)
    foreign = pb.SessionRef(id=a.id, token=b.token)  # b's token on a's id
    calls = {
        "Allocate": lambda ref: stub.Allocate(pb.AllocateRequest(session=ref, num_pages=1)),
        "Free": lambda ref: stub.Free(pb.FreeRequest(session=ref, page_ids=[1])),
        "GetStats": lambda ref: stub.GetStats(pb.GetStatsRequest(session=ref)),
        "CloseSession": lambda ref: stub.CloseSession(pb.CloseSessionRequest(session=ref)),
        "Watch": lambda ref: next(iter(stub.Watch(pb.WatchRequest(session=ref)))),
    }
    for name, call in calls.items():
        if name != "GetStats":  # GetStats without a session is allowed (global numbers)
            expect(lambda: call(missing), C.INVALID_ARGUMENT, "session is required")
        expect(lambda: call(unknown), C.NOT_FOUND, "no session 999999")
        expect(lambda: call(foreign), C.PERMISSION_DENIED, f"token does not match session {a.id}")
    still_serving(c, a)


def test_closed_session(env):
    d, c, a, b, stub = env
    ref = pb.SessionRef(id=b.id, token=b.token)
    b.close()
    expect(lambda: stub.Allocate(pb.AllocateRequest(session=ref, num_pages=1)), C.FAILED_PRECONDITION, f"session {b.id} is closed", "closed by client")
    expect(lambda: stub.Free(pb.FreeRequest(session=ref, page_ids=[1])), C.FAILED_PRECONDITION, "is closed")
    still_serving(c, a)


def test_free_foreign_unknown_and_repeated_pages_loses_nothing(env):
    d, c, a, b, stub = env
    mine = a.allocate(2)
    theirs = b.allocate(2)
    ids = [p.id for p in mine]
    # a page of another session: NOT_FOUND, and nothing of ours freed with it
    expect(lambda: stub.Free(pb.FreeRequest(session=ref(a), page_ids=[ids[0], theirs[0].id])), C.NOT_FOUND,
           f"page {theirs[0].id} is not held by session {a.id}", "nothing was freed")
    expect(lambda: stub.Free(pb.FreeRequest(session=ref(a), page_ids=[ids[0], 10**12])), C.NOT_FOUND, f"page {10**12}")
    expect(lambda: stub.Free(pb.FreeRequest(session=ref(a), page_ids=[ids[0], ids[0]])), C.INVALID_ARGUMENT,
           f"page {ids[0]} appears more than once", "nothing was freed")
    expect(lambda: stub.Free(pb.FreeRequest(session=ref(a), page_ids=[])), C.INVALID_ARGUMENT, "page_ids is empty")
    assert a.my_stats().pages_held == 2 and b.my_stats().pages_held == 2
    # b's data untouched
    theirs[0].write(0, b"mine")
    assert theirs[0].read(0, 4) == b"mine"
    a.free(mine)
    # freeing twice: the second time the page is not ours any more
    expect(lambda: stub.Free(pb.FreeRequest(session=ref(a), page_ids=[ids[0]])), C.NOT_FOUND, "is not held")
    b.free(theirs)
    still_serving(c, a)


def test_oversized_request(env):
    d, c, a, b, stub = env
    ids = list(range(2**60, 2**60 + 600_000))  # 9-byte varints: ~5.4 MB, over the 4 MiB message limit
    expect(lambda: stub.Free(pb.FreeRequest(session=ref(a), page_ids=ids)), C.RESOURCE_EXHAUSTED)
    still_serving(c, a)


def test_open_session_bad_input(env):
    d, c, a, b, stub = env
    ch = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ch.connect(d.fd_socket)
    hello = fdchannel.recv_record(ch)
    assert isinstance(hello, fdchannel.Hello)
    good = hello.secret
    expect(lambda: stub.OpenSession(pb.OpenSessionRequest(channel_secret=good, name="")), C.INVALID_ARGUMENT, "session name must be 1-128")
    expect(lambda: stub.OpenSession(pb.OpenSessionRequest(channel_secret=good, name="x" * 129)), C.INVALID_ARGUMENT, "1-128")
    expect(lambda: stub.OpenSession(pb.OpenSessionRequest(channel_secret=good, name="bad\nname")), C.INVALID_ARGUMENT, "printable")
    expect(lambda: stub.OpenSession(pb.OpenSessionRequest(channel_secret=b"short", name="x")), C.INVALID_ARGUMENT, "channel_secret must be 32 bytes")
    expect(lambda: stub.OpenSession(pb.OpenSessionRequest(channel_secret=b"\0" * 32, name="x")), C.FAILED_PRECONDITION, "unknown or already used channel secret")
    expect(lambda: stub.OpenSession(pb.OpenSessionRequest(channel_secret=good, name="x", guaranteed_bytes=10, max_bytes=5)), C.INVALID_ARGUMENT, "exceeds max_bytes")
    expect(lambda: stub.OpenSession(pb.OpenSessionRequest(channel_secret=good, name="x", labels={str(i): "v" for i in range(17)})), C.INVALID_ARGUMENT, "at most 16 labels")
    expect(lambda: stub.OpenSession(pb.OpenSessionRequest(channel_secret=good, name="x", guaranteed_bytes=1 << 40)), C.RESOURCE_EXHAUSTED, "guarantees would total")
    # after all that the secret still works, exactly once
    ok = stub.OpenSession(pb.OpenSessionRequest(channel_secret=good, name="fine"))
    assert ok.session.id > 0 and len(ok.session.token) == 32
    expect(lambda: stub.OpenSession(pb.OpenSessionRequest(channel_secret=good, name="again")), C.FAILED_PRECONDITION, "already used")
    ch.close()
    still_serving(c, a)


def test_admin_rpcs_need_admin_and_valid_fields(env, daemon_factory):
    d, c, a, b, stub = env
    expect(lambda: stub.SetSessionLimits(pb.SetSessionLimitsRequest(admin=ref(a), session_id=b.id, set_fields=["bogus"])), C.INVALID_ARGUMENT, "set_fields may name")
    expect(lambda: stub.SetSessionLimits(pb.SetSessionLimitsRequest(admin=ref(a), session_id=b.id)), C.INVALID_ARGUMENT, "set_fields is empty")
    expect(lambda: stub.SetSessionLimits(pb.SetSessionLimitsRequest(admin=ref(a), session_id=424242, set_fields=["priority"])), C.NOT_FOUND, "no session 424242")
    expect(lambda: stub.RequestShrink(pb.RequestShrinkRequest(admin=ref(a), session_id=424242)), C.NOT_FOUND, "no session 424242")
    # a non-admin daemon configuration: nobody but the daemon's own uid is admin
    # (uid 0 runs the tests, so only a different uid can be refused; see test_isolation)
    still_serving(c, a)


def test_garbage_on_fd_channel_gets_an_error_and_the_channel_closes(env):
    """A record that breaks the wire spec (protos/kvcached/v1/fdchannel.spec.json,
    on_protocol_error): the daemon answers with an ERROR naming the problem,
    closes that channel and its descriptors, and keeps serving everyone else."""
    d, c, a, b, stub = env
    ch = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ch.connect(d.fd_socket)
    ch.settimeout(5)
    fdchannel.recv_record(ch)
    r, w = __import__("os").pipe()
    fdchannel.send_record(ch, b"\xff" * 100, [r])  # nonsense with an fd attached
    err = fdchannel.recv_record(ch)
    assert isinstance(err, fdchannel.Error) and err.code == C.INVALID_ARGUMENT.value[0], err
    assert err.message == "fd channel protocol error: bad magic 0xffffffff", err.message
    assert fdchannel.recv_record(ch) is None  # closed
    ch.close()
    __import__("os").close(r)
    __import__("os").close(w)
    still_serving(c, a)
