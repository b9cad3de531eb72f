"""A tenant that floods the control (gRPC) socket with connections that never
call: `flood.py N SECONDS` connects N Unix stream sockets to
$KVCACHED_SOCKET as fast as it can and sends nothing on them, holds what
it got for SECONDS, watching which ones the daemon closes, then prints one
JSON line and exits:

  {"connected": n, "refused": n, "closed_early": n, "held": n, "closed_later": n, "first_close_after": s}

connected: connect() succeeded (a blocking connect: it waits while the
daemon's listen backlog is full); refused: connect() failed (errno counted
too); held: still open SETTLE seconds after the last connect (the daemon
admitted it); closed_early: the others (refused: closed by the daemon by
then); closed_later: held ones the daemon closed before SECONDS ran out
(the idle timeout), first_close_after: the earliest of those, in seconds
after its connect.
KVCACHED_TEST_AS_UID=uid:gid: become that user first (after raising
RLIMIT_NOFILE, which needs root)."""

from __future__ import annotations

import collections
import errno
import json
import os
import resource
import select
import socket
import sys
import time

SETTLE = 3.0  # seconds after the last connect by which refused connections are closed


def main() -> int:
    n, seconds = int(sys.argv[1]), float(sys.argv[2])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    spec = os.environ.get("KVCACHED_TEST_AS_UID")
    if spec:
        uid, gid = (int(x) for x in spec.split(":"))
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    path = os.environ["KVCACHED_SOCKET"]
    socks: dict[int, tuple[socket.socket, float]] = {}
    errs: collections.Counter = collections.Counter()
    poller = select.epoll()
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # blocking: waits while the daemon's backlog is full
        try:
            s.connect(path)
        except OSError as exc:
            errs[errno.errorcode.get(exc.errno, str(exc.errno))] += 1
            s.close()
            continue
        s.setblocking(False)
        socks[s.fileno()] = (s, time.monotonic())
        poller.register(s.fileno(), select.EPOLLIN | select.EPOLLRDHUP)
    t_connected = time.monotonic()
    closed: dict[int, float] = {}  # fd -> seconds after its connect when the daemon closed it
    held: set[int] = set()
    checkpoint = t_connected + SETTLE
    end = t_connected + seconds
    while time.monotonic() < end and len(closed) < len(socks):
        if not held and time.monotonic() >= checkpoint:
            held = set(socks) - set(closed)  # what the daemon still holds once refusals are done
        for fd, _ in poller.poll(0.2):
            s, t0 = socks[fd]
            try:
                data = s.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:  # EOF: the daemon closed it (a refusal's answer may come first)
                closed[fd] = time.monotonic() - t0
                poller.unregister(fd)
    if not held:
        held = set(socks) - set(closed)
    later = [closed[fd] for fd in held if fd in closed]
    print(json.dumps({
        "connected": len(socks), "refused": sum(errs.values()), "errors": dict(errs),
        "closed_early": len(socks) - len(held), "held": len(held), "closed_later": len(later),
        "first_close_after": round(min(later), 2) if later else None,
        "connect_seconds": round(t_connected - min((t for _, t in socks.values()), default=t_connected), 2),
    }), flush=True)
    for s, _ in socks.values():
        s.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
