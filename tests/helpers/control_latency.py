"""What the control socket's front door costs a gRPC call:
`python tests/helpers/control_latency.py [N]` starts a host daemon, then
times GetInfo through the control socket (the front door's relay) and
directly on grpcio's private socket (which only the daemon's uid and root
can reach), in interleaved blocks of 500 calls, N calls each (default
10,000), and prints p50/p99 of both. docs/reliability.md quotes it."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import grpc

from kvcached_service._generated.kvcached.v1 import kvcached_pb2 as pb
from kvcached_service._generated.kvcached.v1 import kvcached_pb2_grpc as pbg
from kvcached_service.client.health import wait_serving


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    d = tempfile.mkdtemp(prefix="kvc-lat-")
    sock = os.path.join(d, "k.sock")
    p = subprocess.Popen([sys.executable, "-m", "kvcached_service.server", "--socket", sock, "--backend", "host",
                          "--memory-limit", "256MiB", "--log-level", "WARNING"])
    try:
        assert wait_serving(sock, 30), "the daemon did not start"
        private = os.path.join(d, ".k.sock.grpc", "grpc.sock")  # server/transports/control.py: beside the socket
        stubs = {"front door": pbg.KVCachedStub(grpc.insecure_channel("unix:" + sock)),
                 "grpcio directly": pbg.KVCachedStub(grpc.insecure_channel("unix:" + private, options=[("grpc.use_local_subchannel_pool", 1)]))}
        times: dict[str, list[float]] = {k: [] for k in stubs}
        for st in stubs.values():
            for _ in range(300):
                st.GetInfo(pb.GetInfoRequest(), timeout=5)
        for _ in range(max(1, n // 500)):
            for k, st in stubs.items():
                for _ in range(500):
                    t0 = time.perf_counter()
                    st.GetInfo(pb.GetInfoRequest(), timeout=5)
                    times[k].append(time.perf_counter() - t0)
        for k, ts in times.items():
            ts.sort()
            print(f"{k}: GetInfo n={len(ts)} p50 {ts[len(ts) // 2] * 1e6:.0f} us p99 {ts[int(len(ts) * 0.99)] * 1e6:.0f} us")
        print(f"load average: {os.getloadavg()[0]:.1f}")
    finally:
        p.terminate()
        p.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
