"""What the control socket's relay costs (issue 26 item 3): the same gRPC
calls through the control socket (server/transports/control.py's front door: accept,
SO_PEERCRED, every HTTP/2 byte relayed to grpcio by relay.c) and
directly to grpcio's private socket, against one daemon, in one run:

    scripts/bench.sh --backend host --only relay        (the table: relay beside direct, and the ratio)
    python -m bench.relay [--calls N] [--rounds R]      (the same, on its own, as text)

Calls: GetStats (no session: global and device numbers) and
OpenSession + CloseSession (a fresh fd channel each time, its HELLO secret
opens the session, the daemon runs with --grpc-page-ops so CloseSession is a
gRPC call too). Each is timed from the client (p50/p99 of each call) and the
daemon's CPU (utime + stime of every thread, /proc/PID/stat) is read around
each block of calls: CPU per call is the delta over the block divided by its
calls (the client's own CPU is not in it). The two paths alternate in
`rounds` blocks so that other load on the machine falls on both alike.

grpcio's private socket is only reachable by the daemon's uid (and root):
this process runs as the daemon's uid. A call there has no relay behind it,
so the servicer sees no peer credentials and treats the caller as trusted
(service.py `_uid`): the work the daemon does per call is the same, less
the relay's.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import socket
import sys
import tempfile
import time

from . import common
from .common import MiB, Daemon, summary_us

PATHS = ("relay", "direct")


def private_socket(control_socket: str) -> str:
    """grpcio's private socket of the daemon on `control_socket`
    (server/transports/control.py ControlFront._private_dir: `.<name>.grpc/grpc.sock`
    beside the control socket when that path is short enough)."""
    parent, name = os.path.split(os.path.abspath(control_socket))
    path = os.path.join(parent, f".{name}.grpc", "grpc.sock")
    if not os.path.exists(path):
        raise RuntimeError(f"no grpcio private socket at {path} (control socket path too long? the daemon then uses a temp dir)")
    return path


def measure(d: Daemon, calls: int, rounds: int, warmup: int = 50) -> dict:
    import grpc

    from kvcached_service import fdchannel
    from kvcached_service._generated.kvcached.v1 import kvcached_pb2 as pb
    from kvcached_service._generated.kvcached.v1 import kvcached_pb2_grpc as pb_grpc

    targets = {"relay": d.socket, "direct": private_socket(d.socket)}
    channels = {p: grpc.insecure_channel(f"unix:{t}") for p, t in targets.items()}
    stubs = {p: pb_grpc.KVCachedStub(ch) for p, ch in channels.items()}
    fd_socket = stubs["relay"].GetInfo(pb.GetInfoRequest(), timeout=30).fd_socket

    def get_stats(stub) -> float:
        t0 = time.perf_counter()
        stub.GetStats(pb.GetStatsRequest(), timeout=30)
        return time.perf_counter() - t0

    def open_close(stub) -> float:
        ch = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            ch.connect(fd_socket)
            hello = fdchannel.recv_record(ch)
            t0 = time.perf_counter()
            ref = stub.OpenSession(pb.OpenSessionRequest(channel_secret=hello.secret, name="bench-relay"), timeout=30).session
            stub.CloseSession(pb.CloseSessionRequest(session=ref), timeout=30)
            return time.perf_counter() - t0
        finally:
            ch.close()

    ops = {"getstats": get_stats, "open_close": open_close}
    out: dict = {"calls": calls, "rounds": rounds, "sockets": targets}
    for op, fn in ops.items():
        for p in PATHS:  # warm both connections (and grpcio's threads) first
            for _ in range(warmup):
                fn(stubs[p])
        lat: dict = {p: [] for p in PATHS}
        cpu: dict = {p: 0.0 for p in PATHS}
        per_round = max(1, calls // rounds)
        for r in range(rounds):
            for p in (PATHS if r % 2 == 0 else PATHS[::-1]):
                c0 = common.cpu_seconds(d.pid)
                for _ in range(per_round):
                    lat[p].append(fn(stubs[p]))
                cpu[p] += common.cpu_seconds(d.pid) - c0
        for p in PATHS:
            n = len(lat[p])
            out[f"{op}_{p}"] = {**summary_us(lat[p]), "daemon_cpu_us_per_call": cpu[p] / n * 1e6}
    for ch in channels.values():
        ch.close()
    return out


def run(c) -> dict:
    """bench/suite.py's scenario `relay` (host backend or CUDA: the relay
    does not depend on it)."""
    calls = c.q(300, 3000)
    d = c.daemon("relay", ["--memory-limit", str(64 * MiB), "--grpc-page-ops"], device_bytes=1 << 30)
    try:
        return measure(d, calls, rounds=c.q(2, 10))
    finally:
        d.stop()


def text(res: dict) -> str:
    lines = [f"{res['calls']} calls per path in {res['rounds']} alternating blocks; daemon CPU = utime+stime of the daemon process",
             f"{'call':<28} {'path':<7} {'p50 us':>9} {'p99 us':>9} {'CPU us/call':>12}"]
    for op, label in (("getstats", "GetStats"), ("open_close", "OpenSession+CloseSession")):
        for p in PATHS:
            s = res[f"{op}_{p}"]
            lines.append(f"{label:<28} {p:<7} {s['p50_us']:9.1f} {s['p99_us']:9.1f} {s['daemon_cpu_us_per_call']:12.1f}")
        r, dd = res[f"{op}_relay"], res[f"{op}_direct"]
        lines.append(f"{label:<28} {'ratio':<7} {r['p50_us'] / dd['p50_us']:9.2f} {r['p99_us'] / dd['p99_us']:9.2f} "
                     f"{r['daemon_cpu_us_per_call'] / dd['daemon_cpu_us_per_call']:12.2f}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.relay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=3000, help="calls of each kind per path")
    ap.add_argument("--rounds", type=int, default=10, help="alternating blocks the calls are split into")
    a = ap.parse_args()
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="kvc-bench-relay-"))
    d = Daemon(workdir, "relay", "host", ["--page-size", str(2 * MiB), "--memory-limit", str(64 * MiB),
                                          "--host-memory", str(1 << 30), "--grpc-page-ops"])
    try:
        print(text(measure(d, a.calls, a.rounds)))
    finally:
        d.stop()
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
