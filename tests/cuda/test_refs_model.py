"""How the test driver keeps a process's references to pages (issue 18):
`KVCACHED_TESTDRV_REFS=table` (the default) keeps them in one reference
table per process, so a process holding thousands of pages has no open fd
and no host mapping per page; `fds` is the earlier model (one page-directory
description and one mmap per page). Each test runs both and checks both
outcomes: the semantics are the same, only the per-page fds and mappings
differ (tests/cudadriver/README.md, "The model")."""

from __future__ import annotations

import os

import pytest

pytestmark = [pytest.mark.usefixtures("needs_testdriver"),
              pytest.mark.testdriver("its reference models (KVCACHED_TESTDRV_REFS), granularity knob and leak report")]

SMALL = 64 << 10  # granularity for these tests: many pages, little memory

MANY = """
import resource
d = drv(); cu = cu_mod()
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(400, hard), hard))
init()
def fds(): return len(os.listdir("/proc/self/fd"))
def maps():
    with open("/proc/self/maps") as f: return sum(1 for _ in f)
n, G = 1500, {gran}
base = reserve(n * G)
f0, m0 = fds(), maps()
hs, err = [], None
try:
    for i in range(n):
        h = create(G); hs.append(h)
        d.cuMemMap(base + i * G, G, 0, h, 0)
    set_access(base, n * G)
    for i in range(0, n, 7):
        write(base + i * G + 100, b"page %d" % i)
    d.cuCtxSynchronize()
    imported = []
    for h in hs[:200]:                      # a second handle to the same page
        fd = export(h); imported.append(import_fd(fd)); os.close(fd)
except cu.CudaDriverError as exc:
    err = exc.name
    out(err=err, created=len(hs))
    raise SystemExit(0)
res = dict(err=None, created=len(hs), fd_growth=fds() - f0, map_growth=maps() - m0, used=used())
res["data"] = all(read(base + i * G + 100, 12).rstrip(b"\\0").startswith(b"page %d" % i) for i in range(0, n, 7))
for h in hs + imported: d.cuMemRelease(h)
res["used_mapped_only"] = used()
d.cuMemUnmap(base, n * G); d.cuMemAddressFree(base, n * G)
res["used_end"] = used()
fini()
out(**res)
"""


def test_a_process_holds_many_pages_without_an_fd_or_mapping_each(sim):
    env = dict(KVCACHED_TESTDRV_GRANULARITY=str(SMALL), KVCACHED_TESTDRV_MEMORY=str(2048 * SMALL))
    r = sim.run(MANY.format(gran=SMALL), KVCACHED_TESTDRV_REFS="table", **env)
    assert r["err"] is None, r.out
    assert r["created"] == 1500
    assert r["fd_growth"] <= 8 and r["map_growth"] <= 8, r.out  # not one per page
    assert r["used"] == 1500 * SMALL and r["data"]
    assert r["used_mapped_only"] == 1500 * SMALL  # the mappings still reference every page
    assert r["used_end"] == 0
    assert r.report["leaks"] == 0 and r.report["mode"]["refs"] == "table"
    # the earlier model: one description per page, so 400 fds end it early
    old = sim.run(MANY.format(gran=SMALL), KVCACHED_TESTDRV_REFS="fds", **env)
    assert old["err"] is not None and old["created"] < 400, old.out


FORKED = """
import json
d = drv(); init()
h = create()
rfd, wfd = os.pipe()
pid = os.fork()
if pid == 0:                 # holds what it inherited until it exits; makes no driver call
    os.close(wfd); os.read(rfd, 1); os._exit(0)
os.close(rfd)
d.cuMemRelease(h)
res = {"while_child_lives": used()}
os.write(wfd, b"x"); os.waitpid(pid, 0)
res["after_child_exits"] = used()
fini()
out(**res)
"""


@pytest.mark.parametrize("refs", ["table", "fds"])
@pytest.mark.parametrize("fork", ["refuse", "allow"])
def test_a_forked_child_keeps_what_it_inherited_until_it_exits(sim, refs, fork):
    from tdkit import GRAN

    r = sim.run(FORKED, KVCACHED_TESTDRV_REFS=refs, KVCACHED_TESTDRV_FORK=fork)
    assert (r["while_child_lives"], r["after_child_exits"]) == (GRAN, 0), r.out
    assert r.report["leaks"] == 0


@pytest.mark.parametrize("refs", ["table", "fds"])
def test_killed_process_references_are_dropped_and_its_table_removed(sim, refs):
    holder = sim.spawn("""
        init()
        hs = [create() for _ in range(3)]
        base = reserve(GRAN); map_rw(base, hs[0])
        out(used=used())
        wait_line()
    """, KVCACHED_TESTDRV_REFS=refs)
    try:
        line = holder.stdout.readline()
        assert '"used": %d' % (3 * (2 << 20)) in line, line + holder.stderr.read()
        holder.kill()
        holder.wait(10)
    finally:
        if holder.poll() is None:
            holder.kill()
    r = sim.run("init(); out(used=used(), tables=sorted(os.listdir(os.environ['KVCACHED_TESTDRV_STATE'] + '/refs')))",
                KVCACHED_TESTDRV_REFS=refs)
    assert r["used"] == 0
    # the dead holder's table went with the scan; only the asking process's own can be there
    assert not [t for t in r["tables"] if t.startswith(f"r{holder.pid}-")], r["tables"]


def test_bad_refs_knob_fails_cuinit_naming_it(sim):
    r = sim.run("out(code=code(drv().cuInit, 0))", KVCACHED_TESTDRV_REFS="kernel")
    assert r["code"] == "CUDA_ERROR_INVALID_VALUE"
    assert "KVCACHED_TESTDRV_REFS=kernel" in r.stderr
