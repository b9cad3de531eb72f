"""Raw gRPC access for tests and helper processes: the daemon's generated
stub on a socket, and a client Session's SessionRef. The Python client has
no protobuf in its API (page operations go on the fd channel), so tests
that exercise the daemon's gRPC page rpcs (kept for tools: grpcurl,
kvcachedctl-like scripts) build their requests here."""

from __future__ import annotations

import grpc

from kvcached_service._generated.kvcached.v1 import kvcached_pb2 as pb
from kvcached_service._generated.kvcached.v1 import kvcached_pb2_grpc as pb_grpc

_channels: dict[str, grpc.Channel] = {}


def stub(target) -> pb_grpc.KVCachedStub:
    """A stub on the daemon's control socket. `target`: a socket path, or
    anything with a `.socket` (kvtest.Daemon) or `.path` (a Client)."""
    path = target if isinstance(target, str) else getattr(target, "socket", None) or target.path
    ch = _channels.get(path)
    if ch is None:
        ch = _channels[path] = grpc.insecure_channel(f"unix:{path}")
    return pb_grpc.KVCachedStub(ch)


def ref(session) -> pb.SessionRef:
    """The SessionRef of a client Session (its id and bearer token)."""
    return pb.SessionRef(id=session.id, token=session.token)
