"""A tenant that hoards fd channels: `hog.py N OPEN` connects N fd channels
(and, if OPEN is 1, opens a session on every channel it was given), prints
one JSON line (how many got HELLO, the ERROR records it got instead, how
many sessions it opened), then waits for a line on stdin and exits.
KVCACHED_TEST_AS_UID=uid:gid: become that user first (after the imports and
after raising RLIMIT_NOFILE, which needs root)."""

from __future__ import annotations

import collections
import json
import os
import resource
import socket
import sys

import grpc

from kvcached_service import fdchannel
from kvcached_service._generated.kvcached.v1 import kvcached_pb2 as pb
from kvcached_service._generated.kvcached.v1 import kvcached_pb2_grpc as pb_grpc


def main() -> int:
    n, do_open = int(sys.argv[1]), sys.argv[2] == "1"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    spec = os.environ.get("KVCACHED_TEST_AS_UID")
    if spec:
        uid, gid = (int(x) for x in spec.split(":"))
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    path = os.environ["KVCACHED_SOCKET"]
    hellos, errors = [], collections.Counter()
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(10)
        s.connect(path + ".fd")
        rec = fdchannel.recv_record(s)
        if isinstance(rec, fdchannel.Hello):
            hellos.append(rec.secret)
            socks.append(s)
        else:
            errors[f"{rec.code}: {rec.message}" if isinstance(rec, fdchannel.Error) else repr(rec)] += 1
            s.close()
    opened = 0
    if do_open:
        stub = pb_grpc.KVCachedStub(grpc.insecure_channel(f"unix:{path}"))
        for secret in hellos:
            stub.OpenSession(pb.OpenSessionRequest(channel_secret=secret, name="hog"), timeout=10)
            opened += 1
    print(json.dumps({"hello": len(hellos), "errors": dict(errors), "opened": opened}), flush=True)
    sys.stdin.readline()
    return 0


if __name__ == "__main__":
    sys.exit(main())
