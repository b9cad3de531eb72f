"""Kill storm: `storm.py SOCKET OUT.json --kills N --concurrency C --seed S`.

One parent imports everything once and then fork()s client children (no gRPC
channel exists in the parent before the last fork: each child makes its own
after the fork, so GRPC_ENABLE_FORK_SUPPORT is not needed). Each child
connects, opens a session and loops: Allocate a random number of pages,
check every page reads as zeros on arrival, stamp it (pid, page id, round),
check the stamps, Free. The parent SIGKILLs each child after a random delay
and starts another, until N children were killed. One child in five is
instead killed the moment it is seen in a given step (the steps of a round
taken in turn, so each is hit however slow a loaded machine makes the
children; after TARGET_WAIT_S without seeing it, at whatever step it is in).

Every child publishes the step it is in to a shared (MAP_SHARED anonymous)
table, so the parent knows where each kill landed (mid-Allocate,
receiving fds, mapping/stamping, mid-Free, ...). A monitor child (also
forked, its own channel) polls GetStats with an admin session every few ms
and records, per snapshot, the pids that still have a session and whether
the books add up; the parent then computes for each killed pid the time
from kill to the first snapshot without its session (an upper bound of the
reclaim time).

Failures the children see (a page not zero on arrival, a stamp that is not
theirs, an unexpected error) are appended to OUT.failures, one JSON object a
line. The parent writes one JSON report to OUT.
"""

from __future__ import annotations

import argparse
import collections
import json
import mmap
import os
import random
import signal
import socket
import struct
import sys
import time

# Everything a child needs, imported once in the parent.
import grpc  # noqa: F401

from kvcached_service import fdchannel
from kvcached_service._generated.kvcached.v1 import kvcached_pb2 as pb
from kvcached_service.client import Client
from raw import ref, stub

PHASES = ["forked", "connect", "open", "allocate", "receive", "map", "stamp", "verify", "free", "idle"]
P = {name: i for i, name in enumerate(PHASES)}
# the steps of a round a targeted kill aims at, in turn
TARGETS = ["allocate", "receive", "map", "stamp", "verify", "free"]
TARGETED = 5  # every fifth child
TARGET_WAIT_S = 5.0
SLOT = 8  # bytes per child slot in the shared phase table
STAMP = struct.Struct("<8sQQQ")  # magic, pid, page id, round
MAGIC = b"KVSTORM!"


def now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def log_failure(path: str, **kw) -> None:
    line = (json.dumps(kw) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


class RawSession:
    """A session driven by raw gRPC calls and a raw fd channel, as a tool
    would (the client library sends page requests on the channel; this
    storm exercises the daemon's gRPC Allocate/Free under SIGKILL)."""

    def __init__(self, sock: str, name: str):
        self.rpc = stub(sock)
        self.ch = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.ch.connect(sock + ".fd")
        hello = fdchannel.recv_record(self.ch)
        if not isinstance(hello, fdchannel.Hello):
            raise RuntimeError(f"fd channel: expected HELLO, got {hello!r}")
        self.ref = self.rpc.OpenSession(pb.OpenSessionRequest(channel_secret=hello.secret, name=name), timeout=30).session
        self.device = self.rpc.GetInfo(pb.GetInfoRequest(), timeout=30).devices[0].uuid

    def receive(self, resp) -> list[int]:
        """The fds of an answered Allocate: its PAGES records came first."""
        fds = [-1] * len(resp.page_ids)
        got = 0
        while got < len(fds):
            rec = fdchannel.recv_record(self.ch)
            if not isinstance(rec, fdchannel.Pages) or rec.allocation_id != resp.allocation_id:
                raise RuntimeError(f"fd channel: expected PAGES of allocation {resp.allocation_id}, got {rec!r}")
            for i, (pid_, fd) in enumerate(zip(rec.page_ids, rec.fds)):
                if resp.page_ids[rec.first_index + i] != pid_:
                    raise RuntimeError(f"page {rec.first_index + i} is {pid_} on the channel, {resp.page_ids[rec.first_index + i]} in the answer")
                fds[rec.first_index + i] = fd
            got += len(rec.fds)
        return fds


def child(sock: str, table: mmap.mmap, slot: int, seed: int, failures: str, max_pages: int, mapped: bool) -> None:
    """A client process: never returns (exits or is killed). mapped: map the
    pages through the client's mapper (CUDA: import + cuMemMap, bytes through
    cuMemcpy) instead of mmap()ing the fds (host)."""

    def phase(name: str) -> None:
        table[slot * SLOT] = P[name]

    mappers: dict = {}

    def phase_mapped(s: RawSession, resp, rnd: int) -> None:
        from kvcached_service.client.cuda_mapper import CudaMapper

        fds = s.receive(resp)
        phase("map")
        mapper = mappers.get(resp.device) or mappers.setdefault(resp.device, CudaMapper(resp.device))
        size = resp.page_size
        base = mapper.reserve(size * len(fds))
        pages = []  # (page id, address, map token)
        for i, (pid_, fd) in enumerate(zip(resp.page_ids, fds)):
            pages.append((pid_, base + i * size, mapper.map(base + i * size, fd, size)))
        phase("stamp")
        zero = bytes(size)
        for pid_, addr, _ in pages:
            data = mapper.read(addr, size)
            if data != zero:
                log_failure(failures, kind="not-zero-on-arrival", pid=pid, page=pid_, round=rnd, head=data[: STAMP.size].hex())
            st = STAMP.pack(MAGIC, pid, pid_, rnd)
            mapper.write(addr, st)
            mapper.write(addr + size - STAMP.size, st)
        phase("verify")
        for pid_, addr, _ in pages:
            st = STAMP.pack(MAGIC, pid, pid_, rnd)
            if mapper.read(addr, STAMP.size) != st or mapper.read(addr + size - STAMP.size, STAMP.size) != st:
                log_failure(failures, kind="foreign-stamp", pid=pid, page=pid_, round=rnd, head=mapper.read(addr, STAMP.size).hex())
        phase("free")
        for _, addr, token in pages:
            mapper.unmap(addr, size, token)
        mapper.release(base, size * len(fds))
        s.rpc.Free(pb.FreeRequest(session=s.ref, page_ids=list(resp.page_ids)), timeout=30)
        phase("idle")

    rng = random.Random(seed)
    pid = os.getpid()
    try:
        phase("connect")
        phase("open")
        s = RawSession(sock, f"storm-{pid}")
        rnd = 0
        while True:
            rnd += 1
            n = rng.choice([1, 1, 2, 3, 8, 16, 64, rng.randint(1, max_pages)])
            phase("allocate")
            try:
                resp = s.rpc.Allocate(pb.AllocateRequest(session=s.ref, num_pages=n), timeout=30)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # the budget is shared: fine
                    phase("idle")
                    time.sleep(0.002)
                    continue
                raise
            phase("receive")
            if mapped:
                phase_mapped(s, resp, rnd)
                continue
            fds = s.receive(resp)
            phase("map")
            size = resp.page_size
            maps = []
            for fd in fds:
                maps.append(mmap.mmap(fd, size))
                os.close(fd)
            phase("stamp")
            zero = bytes(size)
            for pid_, m in zip(resp.page_ids, maps):
                if m[:] != zero:
                    head = bytes(m[: STAMP.size])
                    who = STAMP.unpack(head) if head[:8] == MAGIC else None
                    log_failure(failures, kind="not-zero-on-arrival", pid=pid, page=pid_, round=rnd,
                                stamp=None if who is None else [who[1], who[2], who[3]], head=head.hex())
                st = STAMP.pack(MAGIC, pid, pid_, rnd)
                m[: STAMP.size] = st
                m[size - STAMP.size :] = st
            phase("verify")
            for pid_, m in zip(resp.page_ids, maps):
                st = STAMP.pack(MAGIC, pid, pid_, rnd)
                if m[: STAMP.size] != st or m[size - STAMP.size :] != st:
                    head = bytes(m[: STAMP.size])
                    log_failure(failures, kind="foreign-stamp", pid=pid, page=pid_, round=rnd, head=head.hex())
            for m in maps:
                m.close()
            phase("free")
            s.rpc.Free(pb.FreeRequest(session=s.ref, page_ids=list(resp.page_ids)), timeout=30)
            phase("idle")
    except BaseException as exc:  # noqa: BLE001 - anything unexpected is a failure
        log_failure(failures, kind="error", pid=pid, error=f"{type(exc).__name__}: {exc}")
        os._exit(3)
    os._exit(0)


def monitor(sock: str, path: str, stop_fd: int) -> None:
    """Poll GetStats (admin) and write one line per snapshot:
    t_after_answer books_ok in_use_pages pid pid ..."""
    out = open(path, "w")
    bad = 0
    try:
        client = Client.connect(sock, timeout=30)
        s = client.open_session("storm-monitor")
        me = os.getpid()
        while True:
            r = stub(sock).GetStats(pb.GetStatsRequest(session=ref(s)), timeout=30)
            t = now()
            p = r.total
            ok = p.pooled_bytes + p.in_use_bytes + p.free_bytes == p.budget_bytes
            bad += not ok
            pids = sorted({x.pid for x in r.sessions if x.pid != me})
            out.write(f"{t:.6f} {int(ok)} {p.pages_in_use} " + " ".join(map(str, pids)) + "\n")
            try:
                if os.read(stop_fd, 1) is not None:
                    break
            except BlockingIOError:
                pass
            time.sleep(0.003)
    except BaseException as exc:  # noqa: BLE001
        out.write(f"# monitor error {type(exc).__name__}: {exc}\n")
        out.close()
        os._exit(3)
    out.close()
    os._exit(0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("socket")
    ap.add_argument("out")
    ap.add_argument("--kills", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-pages", type=int, default=300)
    ap.add_argument("--max-delay", type=float, default=0.25)
    ap.add_argument("--mapped", action="store_true", help="map pages with the client's mapper (needed for cuda)")
    a = ap.parse_args()
    failures = a.out + ".failures"
    snaps = a.out + ".snapshots"
    open(failures, "w").close()
    rng = random.Random(a.seed)
    table = mmap.mmap(-1, SLOT * a.concurrency)

    stop_r, stop_w = os.pipe()
    os.set_blocking(stop_r, False)
    mon = os.fork()
    if mon == 0:
        os.close(stop_w)
        monitor(a.socket, snaps, stop_r)
    os.close(stop_r)

    t0 = now()
    live: dict[int, tuple[int, float, int | None]] = {}  # pid -> (slot, kill at, step aimed at or None)
    free_slots = list(range(a.concurrency))
    kills: list[tuple[int, float, str]] = []  # pid, kill time, phase
    exits = collections.Counter()
    started = 0
    while len(kills) < a.kills or live:
        while free_slots and started < a.kills:
            slot = free_slots.pop()
            table[slot * SLOT] = P["forked"]
            seed = rng.randrange(1 << 30)
            pid = os.fork()
            if pid == 0:
                os.close(stop_w)
                child(a.socket, table, slot, seed, failures, a.max_pages, a.mapped)
            started += 1
            if started % TARGETED == 0:  # killed when seen in the step aimed at
                live[pid] = (slot, now() + TARGET_WAIT_S, P[TARGETS[(started // TARGETED) % len(TARGETS)]])
                continue
            # kill soon after start (connect/open) now and then, else mostly in the loop
            delay = rng.uniform(0.0, 0.05) if rng.random() < 0.1 else rng.uniform(0.03, a.max_delay)
            live[pid] = (slot, now() + delay, None)
        # kill whoever is due
        t = now()
        due = sorted((k for k, (slot, at, aim) in live.items() if at <= t or table[slot * SLOT] == aim),
                     key=lambda k: live[k][1])
        for pid in due:
            slot = live[pid][0]
            ph = PHASES[table[slot * SLOT]]
            kt = now()
            os.kill(pid, signal.SIGKILL)
            kills.append((pid, kt, ph))
        for pid in due:
            slot = live.pop(pid)[0]
            _, status = os.waitpid(pid, 0)
            exits["killed" if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL else f"exit{os.WEXITSTATUS(status)}"] += 1
            free_slots.append(slot)
        if not due:  # a targeted child is watched closely: a step may last a millisecond
            nxt = min((at for _, at, _ in live.values()), default=t)
            watch = 0.0002 if any(aim is not None for _, _, aim in live.values()) else 0.005
            time.sleep(max(0.0, min(nxt - now(), watch)))
    storm_s = now() - t0
    # let the last reclaims show up in the monitor, then stop it
    time.sleep(1.2)
    try:
        os.write(stop_w, b"x")
    except BrokenPipeError:  # the monitor already ended (its error is in the snapshots file)
        pass
    _, mstatus = os.waitpid(mon, 0)

    # reclaim time per kill: first snapshot after the kill without the pid
    rows = []
    books_bad = 0
    mon_error = ""
    with open(snaps) as f:
        for line in f:
            if line.startswith("#"):
                mon_error = line.strip()
                continue
            parts = line.split()
            rows.append((float(parts[0]), {int(x) for x in parts[3:]}))
            books_bad += parts[1] != "1"
    times = [r[0] for r in rows]
    import bisect

    reclaim = []
    unresolved = []
    for pid, kt, ph in kills:
        i = bisect.bisect_right(times, kt)
        while i < len(rows) and pid in rows[i][1]:
            i += 1
        if i == len(rows):
            unresolved.append(pid)
        else:
            reclaim.append(rows[i][0] - kt)
    # how often the monitor sampled (the resolution of the reclaim times)
    gaps = [b - a for a, b in zip(times, times[1:])]
    with open(failures) as f:
        fails = [json.loads(x) for x in f if x.strip()]
    report = {
        "kills": len(kills),
        "children": started,
        "exits": dict(exits),
        "storm_seconds": round(storm_s, 2),
        "phases": dict(collections.Counter(ph for _, _, ph in kills)),
        "reclaim_max_s": round(max(reclaim), 4) if reclaim else None,
        "reclaim_p50_s": round(sorted(reclaim)[len(reclaim) // 2], 4) if reclaim else None,
        "reclaim_p99_s": round(sorted(reclaim)[int(len(reclaim) * 0.99)], 4) if reclaim else None,
        "reclaim_over_1s": sum(1 for r in reclaim if r > 1.0),
        "unresolved": unresolved,
        "snapshots": len(rows),
        "snapshot_gap_max_s": round(max(gaps), 4) if gaps else None,
        "snapshot_gap_p50_s": round(sorted(gaps)[len(gaps) // 2], 4) if gaps else None,
        "books_bad_snapshots": books_bad,
        "monitor_status": mstatus,
        "monitor_error": mon_error,
        "failures": fails[:50],
        "failure_count": len(fails),
    }
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k != "failures"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
