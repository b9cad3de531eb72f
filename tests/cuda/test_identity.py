"""Page identity for resume under both identity modes of the test driver
(issue 17 item 3; docs/cuda.md, "Page identity").

A restarted daemon adopts the pages a returning client re-sends; it checks
each fd against the identity its journal recorded (today: the fd's fstat
(st_dev, st_ino)). With KVCACHED_TESTDRV_FD_IDENTITY=distinct (one inode
per page) a client that sends the wrong fd for a page is refused. With
`same` (every export one inode, as an fd of the real driver's device node
would be) the check cannot tell pages apart: the daemon adopts whatever
page the fd names under the id the client claims. That is the bug part B of
issue 17 fixes; the test below is marked xfail(strict) until then, so the
fix turns it into a pass and the marker must go.
"""

from __future__ import annotations

import signal

import grpc
import pytest

from kvcached_service import fdchannel
from kvcached_service._generated.kvcached.v1 import kvcached_pb2 as pb
from kvcached_service._generated.kvcached.v1 import kvcached_pb2_grpc as pb_grpc


def _resume(d, sid, token, ids, fds):
    import socket

    ch = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ch.connect(d.fd_socket)
    try:
        hello = fdchannel.recv_record(ch)
        fdchannel.send_record(ch, fdchannel.encode_adopt(sid, 0, len(ids), ids), fds)
        stub = pb_grpc.KVCachedStub(grpc.insecure_channel(f"unix:{d.socket}"))
        return stub.ResumeSession(
            pb.ResumeSessionRequest(channel_secret=hello.secret, session_id=sid, resume_token=token, page_ids=ids), timeout=10
        )
    finally:
        ch.close()


def _swapped_claim(daemon_factory, tmp_path, mode):
    state = str(tmp_path / "state")
    env = {"KVCACHED_TESTDRV_FD_IDENTITY": mode}
    d = daemon_factory("cuda", env=env, state_dir=state)
    c = d.client()
    s = c.open_session("a")
    resp, fds = s.allocate_fds(2)
    sid, token, ids = s.id, s.resume_token, list(resp.page_ids)
    s._closed = True  # we play the client: no automatic resume
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()
    d2 = daemon_factory("cuda", env=env, socket=d.socket, state_dir=state)
    try:
        with pytest.raises(grpc.RpcError) as info:
            _resume(d2, sid, token, ids, [fds[1], fds[0]])  # each page claimed with the other's fd
        return info.value
    finally:
        fdchannel.close_fds(fds)
        c.close()


def test_resume_refuses_another_pages_fd_with_distinct_identity(daemon_factory, tmp_path):
    err = _swapped_claim(daemon_factory, tmp_path, "distinct")
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED, err.details()
    assert "is not the page the journal recorded" in err.details()


@pytest.mark.xfail(
    strict=True,
    reason="issue 17 part B: the resume check compares fstat identities, which are the same for every export "
    "when the driver's exported fds are fds of one device node (KVCACHED_TESTDRV_FD_IDENTITY=same)",
)
def test_resume_refuses_another_pages_fd_with_same_identity(daemon_factory, tmp_path):
    err = _swapped_claim(daemon_factory, tmp_path, "same")
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED, err.details()
