"""fork() and the CUDA path, on any libcuda: driver calls in a forked child
(the public API: refused after the parent's cuInit, allowed before it),
pages a forked child inherits, and a daemon client that forks (its child
inherits the session's sockets and mappings) and then dies.

What the test driver's fork modes change (`KVCACHED_TESTDRV_FORK=allow`,
its leak report's view of a child) is compared in test_strictness.py and
test_refs_model.py."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time

from tdkit import GRAN

FORK = """
import json
d = drv(); init()
h = create(); base = reserve(GRAN); map_rw(base, h); write(base, b"parent"); d.cuCtxSynchronize()
rfd, wfd = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(rfd)
    res = {"init": code(d.cuInit, 0), "count": code(d.cuDeviceGetCount, byref(ctypes.c_int())),
           "create": code(create), "read": code(read, base, 6), "set_current": code(d.cuCtxSetCurrent, None)}
    os.write(wfd, json.dumps(res).encode())
    os._exit(0)
os.close(wfd)
child = json.loads(os.read(rfd, 4096))
os.waitpid(pid, 0)
out(child=child, parent=read(base, 6).decode())
d.cuMemUnmap(base, GRAN); d.cuMemAddressFree(base, GRAN); d.cuMemRelease(h); fini()
"""


def test_use_after_fork_is_refused_in_the_child(sim):
    """The CUDA runtime reports an initialisation error in a child forked
    after cuInit; the project never calls the driver there (the gpu-check
    probe's fork row showed NVIDIA's driver answering NOT_INITIALIZED)."""
    r = sim.run(FORK)
    assert r["child"] == dict.fromkeys(("init", "count", "create", "read", "set_current"), "CUDA_ERROR_NOT_INITIALIZED")
    assert r["parent"] == "parent"  # the parent goes on
    sim.assert_clean(r)


def test_a_child_forked_before_cuinit_may_initialise(sim):
    r = sim.run("""
import json
d = drv()
rfd, wfd = os.pipe()
pid = os.fork()
if pid == 0:
    init(); start = used(); h = create(); res = {"used": used() - start}; drv().cuMemRelease(h); fini()
    os.write(wfd, json.dumps(res).encode()); os._exit(0)
os.close(wfd)
child = json.loads(os.read(rfd, 4096)); os.waitpid(pid, 0)
out(child=child)
""")
    assert r["child"] == {"used": GRAN}


FORKED = """
import json
d = drv(); init()
start = used()
h = create()
fd = export(h)
rfd, wfd = os.pipe()
pid = os.fork()
if pid == 0:                 # holds what it inherited (the export too) until it exits; makes no driver call
    os.close(wfd); os.read(rfd, 1); os._exit(0)
os.close(rfd)
os.close(fd)
d.cuMemRelease(h)
res = {"while_child_lives": used() - start}
os.write(wfd, b"x"); os.waitpid(pid, 0)
res["after_child_exits"] = used() - start
fini()
out(**res)
"""


def test_pages_a_forked_child_inherited_come_back_when_it_exits(sim):
    """A process forks while it holds a page and an exported fd of it (as
    a client that runs a helper without exec does), then lets go of both:
    once the child exits too, the page is back, device-wide. While the
    child lives, the test driver keeps the page (the child's inherited fd
    names it); what NVIDIA's driver does then is recorded, not asked."""
    r = sim.run(FORKED)
    assert r["after_child_exits"] == 0, r.out
    if sim.private:
        assert r["while_child_lives"] == GRAN, r.out
    else:
        assert r["while_child_lives"] in (0, GRAN), r.out
        print(f"\nwhile the forked child lived: {r['while_child_lives'] >> 20} MiB still held")
    sim.assert_clean(r)


CLIENT = """
import json, os, sys, time
from kvcached_service.client import Client
c = Client.connect(os.environ["KVCACHED_SOCKET"])
s = c.open_session("forks")
pages = s.allocate(3)
for i, p in enumerate(pages):
    p.write(0, b"page %d" % i)
pid = os.fork()
if pid == 0:                 # inherits the session's sockets and the mapped pages; makes no call, outlives us
    time.sleep(600)
    os._exit(0)
print(json.dumps({"child": pid, "pages": [p.id for p in pages],
                  "read": [p.read(0, 6).decode() for p in pages]}), flush=True)
time.sleep(600)
"""


def test_a_client_that_forked_and_died_gives_its_pages_back(daemon_factory):
    """A daemon client on the CUDA backend forks (the child inherits the
    session's gRPC and fd-channel sockets and the mapped pages, and lives
    on), then is SIGKILLed: the daemon ends its session within a second
    (the peer process's exit, not the socket's close, is the signal: the
    child still holds the socket), the books add up, and a new session is
    served while the child still lives."""
    from kvtest import assert_books, wait_until

    d = daemon_factory("cuda")
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CLIENT)], env=d.client_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    child = None
    try:
        line = p.stdout.readline()
        assert line, p.stderr.read()
        got = json.loads(line)
        child = got["child"]
        assert got["read"] == ["page 0", "page 1", "page 2"]
        with d.client() as c:
            assert c.stats().total.pages_in_use == 3
            p.send_signal(signal.SIGKILL)
            p.wait(10)
            t0 = time.monotonic()
            assert wait_until(lambda: c.stats().total.pages_in_use == 0, timeout=5), (c.stats().total, d.log_text())
            took = time.monotonic() - t0
            assert took < 1.5, f"the session of a client that forked ended {took:.2f} s after it died"
            assert_books(c.stats())
            with c.open_session("next") as s:  # the daemon serves on while the child still holds its inheritance
                pages = s.allocate(3)
                assert [pg.read(0, 6) for pg in pages] == [bytes(6)] * 3  # never another session's bytes
                s.free(pages)
            assert_books(c.stats())
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        if child is not None:
            try:
                import os

                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
