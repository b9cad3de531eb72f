"""Client processes the harness starts (one per simulated engine).

    python -m bench.worker pairs KIND PAGE_SIZE
        Opens a session and a one-page Region on the daemon at $KVCACHED_SOCKET,
        prepares the in-process baseline, prints {"ready": ...}, then runs
        commands read from stdin, one JSON object per line, answering each
        with one JSON line:
          {"op": "rtt", "mode": "daemon"|"grpc"|"base", "n": N, "start": T}
              N Allocate+Free pairs (daemon: region.map + region.unmap of one
              page; base: create+map+unmap+release in-process), starting at
              wall-clock time T; answers {"lat": [seconds...]}
          {"op": "tput", "mode": ..., "start": T, "secs": S}
              as many pairs as fit in [T, T+S); answers {"pairs": n}
          {"op": "quit"}

    python -m bench.worker holder MODE KIND PAGE_SIZE BYTES
        The idle session of the reclaim scenario. MODE daemon: maps BYTES
        through a Region, touches one byte per page (a page an engine used),
        answers reclaim requests by releasing pages from the end of the
        region, prints {"ready": ...}; exits on "quit". MODE base: the same
        pages made in-process without a daemon; on "free" it unmaps and
        releases them all, then prints {"freed": wall-clock time}.
"""

from __future__ import annotations

import json
import sys
import threading
import time

from . import common


def _out(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _sleep_until(t: float) -> None:
    d = t - time.time()
    if d > 0:
        time.sleep(d)


class GrpcPairs:
    """The same one-page Allocate+Free, as gRPC Allocate/Free calls (the
    daemon keeps them for tools; the client library sends page requests on
    the fd channel): a raw session on a raw fd channel, pages mapped with
    the client's mapper."""

    def __init__(self, socket_path: str, page_size: int):
        import os
        import socket

        import grpc

        from kvcached_service import fdchannel
        from kvcached_service._generated.kvcached.v1 import kvcached_pb2 as pb
        from kvcached_service._generated.kvcached.v1 import kvcached_pb2_grpc as pb_grpc
        from kvcached_service.client.mapping import mapper_for

        self.pb, self.fdchannel = pb, fdchannel
        self.stub = pb_grpc.KVCachedStub(grpc.insecure_channel(f"unix:{socket_path}"))
        info = self.stub.GetInfo(pb.GetInfoRequest(), timeout=60)
        self.ch = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.ch.connect(info.fd_socket)
        hello = fdchannel.recv_record(self.ch)
        self.ref = self.stub.OpenSession(pb.OpenSessionRequest(channel_secret=hello.secret, name=f"bench-pairs-grpc-{os.getpid()}"), timeout=60).session
        dev = info.devices[0]
        self.mapper = mapper_for(dev.kind, dev.uuid)
        self.page_size = page_size
        self.slot = self.mapper.reserve(page_size)

    def pair(self) -> None:
        pb = self.pb
        resp = self.stub.Allocate(pb.AllocateRequest(session=self.ref, num_pages=1), timeout=60)
        rec = self.fdchannel.recv_record(self.ch)
        token = self.mapper.map(self.slot, rec.fds[0], self.page_size)
        self.mapper.unmap(self.slot, self.page_size, token)
        self.stub.Free(pb.FreeRequest(session=self.ref, page_ids=list(resp.page_ids)), timeout=60)

    def close(self) -> None:
        self.mapper.release(self.slot, self.page_size)
        self.stub.CloseSession(self.pb.CloseSessionRequest(session=self.ref), timeout=60)
        self.ch.close()
        self.mapper.close()


def pairs(kind: str, page_size: int) -> None:
    import os

    from kvcached_service.client import Client

    client = Client.connect(timeout=60)
    session = client.open_session(f"bench-pairs-{__import__('os').getpid()}")
    region = session.region(page_size)
    # the same work with Allocate/Free as gRPC calls instead of fd channel requests
    grpc_pairs = GrpcPairs(os.environ["KVCACHED_SOCKET"], page_size)
    grpc_pairs.pair()
    base = common.inproc(kind, page_size)
    slot = base.reserve(page_size)
    # warm both paths once (first map creates the client's mapper / context)
    region.map(0, page_size)
    region.unmap(0, page_size)
    base.unmap_release(base.create_map(slot))

    def daemon_pair() -> None:
        region.map(0, page_size)
        region.unmap(0, page_size)

    def base_pair() -> None:
        base.unmap_release(base.create_map(slot))

    def grpc_pair() -> None:
        grpc_pairs.pair()

    _out({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        fn = {"daemon": daemon_pair, "grpc": grpc_pair, "base": base_pair}[cmd["mode"]]
        _sleep_until(cmd["start"])
        if cmd["op"] == "rtt":
            lat = []
            for _ in range(cmd["n"]):
                t0 = time.perf_counter()
                fn()
                lat.append(time.perf_counter() - t0)
            _out({"lat": lat})
        elif cmd["op"] == "tput":
            end = cmd["start"] + cmd["secs"]
            n = 0
            while time.time() < end:
                fn()
                n += 1
            _out({"pairs": n})
    region.close()
    session.close()
    grpc_pairs.close()
    base.free_reservation(slot, page_size)
    base.close()
    client.close()


def holder(mode: str, kind: str, page_size: int, nbytes: int) -> None:
    npages = nbytes // page_size
    if mode == "daemon":
        from kvcached_service.client import Client

        client = Client.connect(timeout=60)
        session = client.open_session("bench-idle-model")
        region = session.region(nbytes)
        chunk = 1024 * page_size  # bounded fds in flight per Allocate
        for off in range(0, nbytes, chunk):
            region.map(off, min(chunk, nbytes - off))
        mapper = session.mapper(region.device.uuid)
        for i in range(npages):
            mapper.write(region.base + i * page_size, b"\x01")
        answered = []

        def on_reclaim(ev) -> None:
            t0 = time.perf_counter()
            n = region.release_pages(ev.pages)
            answered.append({"asked": ev.pages, "gave": n, "secs": time.perf_counter() - t0})

        session.on_reclaim(on_reclaim)
        _out({"ready": True, "pages": region.mapped_pages})
        for line in sys.stdin:
            if line.strip() == "quit":
                break
            if line.strip() == "report":
                _out({"answered": answered, "mapped": region.mapped_pages})
        region.close()
        session.close()
        client.close()
        return
    base = common.inproc(kind, page_size)
    res = base.reserve(nbytes)
    hs = [base.create_map(res + i * page_size) for i in range(npages)]
    for h in hs:
        base.touch(h[0])
    _out({"ready": True, "pages": len(hs)})
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "free":
            for h in hs:
                base.unmap_release(h)
            hs = []
            _out({"freed": time.time()})
        elif cmd == "quit":
            break
    for h in hs:
        base.unmap_release(h)
    base.free_reservation(res, nbytes)
    base.close()


def main(argv: list[str]) -> None:
    if argv[0] == "pairs":
        pairs(argv[1], int(argv[2]))
    elif argv[0] == "holder":
        holder(argv[1], argv[2], int(argv[3]), int(argv[4]))
    else:
        raise SystemExit(f"unknown worker {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
