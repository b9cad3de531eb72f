"""A client process driven by the tests: `client_proc.py MODE [args]`.

Modes (each prints one JSON line on stdout when it reaches its checkpoint):
  hold N NAME            allocate N pages, write a pattern, print ids, wait for
                         a line on stdin, verify the pattern, free, exit
  zeros N                allocate N pages, report whether all read as zeros
  write-free N BYTE      allocate N pages, fill with BYTE, free, exit
  keep-after-free N BYTE allocate N pages, fill, free WITHOUT unmapping, print,
                         wait for stdin, then report what the mapping reads
  raw-allocate N         Allocate over gRPC but never read the fd channel;
                         print and sleep until killed
  loop SECONDS N         allocate/verify/free N pages in a loop; print counts
  churn SECONDS N BYTE   allocate N pages, check every byte is zero, fill
                         them with BYTE, free; in a loop; print counts
  sleep-open             open a session, print, sleep until killed
  orphan N               allocate N pages and write every byte of them (all
                         resident), print; then for each stdin line try
                         Allocate, Free and GetStats and print what each
                         raised (code and message) and whether the pages
                         still hold their bytes; exit at end of input
"""

import json
import os
import sys
import time

from kvcached_service.client import Client
from kvcached_service._generated.kvcached.v1 import kvcached_pb2 as pb
from raw import stub


def out(**kw):
    print(json.dumps(kw), flush=True)


def pattern(page_id: int, size: int) -> bytes:
    unit = page_id.to_bytes(8, "little") + os.getpid().to_bytes(8, "little")
    return (unit * (size // len(unit) + 1))[:size]


def drop_privileges() -> None:
    """KVCACHED_TEST_AS_UID=uid:gid: become that user after every import (the
    interpreter lives where other uids cannot read it), before connecting,
    so the daemon sees that uid on the fd channel."""
    spec = os.environ.get("KVCACHED_TEST_AS_UID")
    if spec:
        import mmap  # noqa: F401 - imported while still privileged
        import kvcached_service.client.cuda_mapper  # noqa: F401
        import kvcached_service.client.mapping  # noqa: F401
        import kvcached_service.client.region  # noqa: F401

        uid, gid = (int(x) for x in spec.split(":"))
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)


def page_mapper(client):
    """The mapper the client library would use for the daemon's first device."""
    from kvcached_service.client.mapping import mapper_for

    dev = client.info.devices[0]
    return mapper_for(dev.kind, dev.uuid)


def main() -> int:
    mode, args = sys.argv[1], sys.argv[2:]
    drop_privileges()
    client = Client.from_env()
    s = client.open_session(f"{mode}-{os.getpid()}")
    if mode == "orphan":
        n = int(args[0])
        pages = s.allocate(n)
        for p in pages:
            p.write(0, bytes([p.id & 0xFF]) * p.size)
        out(session=s.id, pages=[p.id for p in pages], pid=os.getpid(), resumable=s.resumable)
        from kvcached_service.errors import KVCachedError

        def outcome(fn):
            try:
                fn()
                return ["OK", ""]
            except KVCachedError as exc:
                return [exc.code.name, exc.message]

        for _ in sys.stdin:
            out(Allocate=outcome(lambda: s.allocate(1)), Free=outcome(lambda: s.free_ids([pages[0].id])),
                GetStats=outcome(s.stats), intact=all(p.read(0, 64) == bytes([p.id & 0xFF]) * 64 for p in pages))
        return 0
    if mode == "hold":
        n = int(args[0])
        pages = s.allocate(n)
        for p in pages:
            p.write(0, pattern(p.id, 4096))
            p.write(p.size - 4096, pattern(p.id, 4096))
        out(session=s.id, pages=[p.id for p in pages], pid=os.getpid())
        sys.stdin.readline()
        ok = all(p.read(0, 4096) == pattern(p.id, 4096) and p.read(p.size - 4096, 4096) == pattern(p.id, 4096) for p in pages)
        s.free(pages)
        out(intact=ok)
    elif mode == "zeros":
        n = int(args[0])
        pages = s.allocate(n)
        zero = bytes(pages[0].size)
        out(session=s.id, pages=[p.id for p in pages], zeros=all(p.read() == zero for p in pages))
        s.free(pages)
    elif mode == "write-free":
        n, byte = int(args[0]), int(args[1])
        pages = s.allocate(n)
        for p in pages:
            p.write(0, bytes([byte]) * p.size)
        ids = [p.id for p in pages]
        s.free(pages)
        out(session=s.id, pages=ids)
    elif mode == "keep-after-free":
        n, byte = int(args[0]), int(args[1])
        resp, fds = s.allocate_fds(n)
        # mapped as the client library maps pages (mmap on the host backend,
        # import + cuMemMap on CUDA: an exported CUDA fd is no mappable file)
        mapper = page_mapper(client)
        size = resp.page_size
        base = mapper.reserve(n * size)
        addrs = [base + i * size for i in range(n)]
        for addr, fd in zip(addrs, fds):
            mapper.map(addr, fd, size)
            mapper.write(addr, bytes([byte]) * size)
        s.free_ids(resp.page_ids)  # misbehave: keep the mappings and fds
        out(session=s.id, pages=list(resp.page_ids))
        sys.stdin.readline()
        for addr in addrs:  # write again into pages we no longer own
            mapper.write(addr, bytes([byte]) * 16)
        out(still=[mapper.read(addr, 1)[0] for addr in addrs])
        sys.stdin.readline()
    elif mode == "raw-allocate":
        # A client that never reads its fd channel: its own raw channel (the
        # library's channel has a reader thread), a session on it, Allocate.
        import socket as so

        from kvcached_service import fdchannel

        n = int(args[0])
        raw = so.socket(so.AF_UNIX, so.SOCK_SEQPACKET)
        raw.connect(client.info.fd_socket)
        hello = fdchannel.recv_record(raw)
        opened = stub(client).OpenSession(pb.OpenSessionRequest(channel_secret=hello.secret, name="never-reads"))
        resp = stub(client).Allocate(pb.AllocateRequest(session=opened.session, num_pages=n))
        out(session=opened.session.id, pages=list(resp.page_ids))
        time.sleep(3600)
    elif mode == "loop":
        seconds, n = float(args[0]), int(args[1])
        end = time.monotonic() + seconds
        rounds = errors = 0
        while time.monotonic() < end:
            pages = s.allocate(n)
            for p in pages:
                if p.read(0, 64) != bytes(64):
                    errors += 1
                p.write(0, pattern(p.id, 64))
            for p in pages:
                if p.read(0, 64) != pattern(p.id, 64):
                    errors += 1
            s.free(pages)
            rounds += 1
        out(session=s.id, rounds=rounds, errors=errors)
    elif mode == "churn":
        # Allocate, check every byte reads zero, fill with BYTE, Free: as fast
        # as it can, racing the daemon's background zeroer (and another uid).
        seconds, n, byte = float(args[0]), int(args[1]), int(args[2])
        end = time.monotonic() + seconds
        rounds = dirty = 0
        seen: set[int] = set()
        while time.monotonic() < end:
            pages = s.allocate(n, wait=True, wait_timeout_ms=20000)  # the other uid may hold the rest of the budget
            for p in pages:
                seen.add(p.id)
                if p.read() != bytes(p.size):
                    dirty += 1
                p.write(0, bytes([byte]) * p.size)
            s.free(pages)
            rounds += 1
        out(session=s.id, rounds=rounds, dirty=dirty, pages=sorted(seen))
    elif mode == "sleep-open":
        out(session=s.id, pid=os.getpid())
        time.sleep(3600)
    else:
        raise SystemExit(f"unknown mode {mode}")
    s.close()
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
