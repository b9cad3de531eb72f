"""The daemon's request path in one process, without context switches:

    python -m bench.requestpath [--pairs N] [--metrics] [--profile] [--tree DIR]

A Daemon on the host backend (warm pool, so no page is created on the
request path) and its fd channel adapter, with one channel served over a
socketpair; this process plays the client synchronously: it writes an
ALLOCATE, calls the adapter's read callback, reads PAGES and REPLY, writes
the FREE, calls the callback, reads the REPLY. Prints the CPU time per
one-page Allocate+Free pair (daemon and this minimal client together) and,
for scale, the CPU time of the bare socket calls of a record round trip.
--metrics attaches the Prometheus metrics (as --metrics-address does),
--profile prints cProfile's top functions instead, --tree runs the
kvcached_service of another checkout (e.g. one bench/run.py --compare
extracted into build/bench/trees/). docs/benchmarks.md, "Issue 18", has
what it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.requestpath")
    ap.add_argument("--pairs", type=int, default=20000)
    ap.add_argument("--metrics", action="store_true", help="attach the Prometheus metrics to the daemon")
    ap.add_argument("--profile", action="store_true", help="cProfile the pairs, print the top functions")
    ap.add_argument("--tree", default="", help="a directory holding another revision's kvcached_service")
    a = ap.parse_args()
    if a.tree:
        sys.path.insert(0, a.tree)
        for name in [m for m in sys.modules if m == "kvcached_service" or m.startswith("kvcached_service.")]:
            del sys.modules[name]
    from kvcached_service import fdchannel as f
    from kvcached_service.backends.host import HostBackend
    from kvcached_service.config import load_settings
    from kvcached_service.server.transports.channel import ChannelServer
    from kvcached_service.server.core.daemon import Daemon

    page = 2 << 20
    tmp = tempfile.mkdtemp(prefix="kvc-requestpath-")
    settings = load_settings({"socket": f"{tmp}/s.sock", "backend": "host", "memory_limit": str(64 * page),
                              "page_size": str(page), "prealloc": str(8 * page)})

    async def run() -> None:
        daemon = Daemon(settings, HostBackend(1 << 30))
        channels = ChannelServer(daemon, settings)
        daemon.start_devices()
        await daemon.prefill()
        if a.metrics:
            from kvcached_service.server.ops.metrics import Metrics

            Metrics(daemon, process=False)
        client, served = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        channels._admit(served)
        conn = next(iter(channels.channels.values()))
        asyncio.get_running_loop().remove_reader(served.fileno())  # this process calls the read callback itself
        hello = f.recv_record(client)
        daemon.open_session(None, hello.secret, "requestpath", 0, 0, 0, {})

        def pair(i: int) -> None:
            client.send(f.encode_allocate(2 * i + 1, 1))
            channels._read_one(conn)
            pages = f.recv_record(client)
            os.close(pages.fds[0])
            reply = f.recv_record(client)
            if not isinstance(pages, f.Pages) or reply.code != 0:
                raise RuntimeError(f"ALLOCATE answered {pages!r} {reply!r}")
            client.send(f.encode_free(2 * i + 2, list(pages.page_ids)))
            channels._read_one(conn)
            reply = f.recv_record(client)
            if reply.code != 0 or reply.value != 1:
                raise RuntimeError(f"FREE answered {reply!r}")

        for i in range(200):  # warm up
            pair(i)
        if a.profile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            for i in range(a.pairs):
                pair(i)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            return
        t0 = time.process_time()
        for i in range(a.pairs):
            pair(i)
        per_pair = (time.process_time() - t0) / a.pairs * 1e6
        rep = f.encode_reply(1, 0, 1)
        t0 = time.process_time()
        for i in range(a.pairs):
            client.send(f.encode_allocate(i, 1))
            served.recv(4096)
            served.send(rep)
            client.recv(4096)
        bare = (time.process_time() - t0) / a.pairs * 1e6
        print(f"{per_pair:.1f} us CPU per one-page Allocate+Free pair (daemon and client, one process, "
              f"metrics {'on' if a.metrics else 'off'}); bare socket calls of one record round trip: {bare:.1f} us")

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
